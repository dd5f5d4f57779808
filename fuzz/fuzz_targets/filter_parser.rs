//! Fuzzes the `--filter` compiler (the CLI's and the agent's): any text must give a program
//! or an error whose span lies inside the text, never a panic or a stack overflow.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match observer::filter::compile(text, &|name| (name.len() < 16).then_some(7)) {
        Ok(p) => assert!(p.n_terms as usize <= observer_common::filter::MAX_TERMS),
        Err(e) => {
            assert!(e.pos <= text.len(), "{e:?}");
            let _ = e.to_string();
        }
    }
});
