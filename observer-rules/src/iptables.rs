//! The `iptables-save` / `ip6tables-save` syntax: a faithful model of tables, chains and rules
//! (counters, comments, negation, goto), a parser that never panics and reports line and column,
//! and a printer whose output parses back to the same model. Meaning is assigned later
//! (`compile`), so options we do not understand survive verbatim.

use std::collections::HashMap;

use crate::error::ParseError;

/// Packet and byte counters as printed by `iptables-save -c` (`[pkts:bytes]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    pub packets: u64,
    pub bytes: u64,
}

/// All tables of one `iptables-save` dump (one address family).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SaveFile {
    pub tables: Vec<Table>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    pub name: String,
    pub chains: Vec<Chain>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Chain {
    pub name: String,
    /// `Some("ACCEPT")`/`Some("DROP")` for built-in chains, `None` for user chains (`-`).
    pub policy: Option<String>,
    pub counters: Option<Counters>,
    pub rules: Vec<Rule>,
}

/// One `-A CHAIN ...` line, kept as the ordered list of its parts.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub chain: String,
    pub counters: Option<Counters>,
    pub items: Vec<Item>,
    pub target: Option<Target>,
}

/// The built-in (non `-m`) selectors of a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basic {
    Src,
    Dst,
    Proto,
    InIface,
    OutIface,
}

impl Basic {
    fn flag(self) -> &'static str {
        match self {
            Basic::Src => "-s",
            Basic::Dst => "-d",
            Basic::Proto => "-p",
            Basic::InIface => "-i",
            Basic::OutIface => "-o",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    Basic {
        neg: bool,
        kind: Basic,
        value: String,
    },
    Fragment {
        neg: bool,
    },
    /// `-m name --opt args ...`; `implicit` when the options followed `-p tcp` without `-m`.
    Module {
        name: String,
        implicit: bool,
        opts: Vec<Opt>,
    },
}

/// One `[!] --name arg...` option of a match or target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opt {
    pub neg: bool,
    pub name: String,
    pub args: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// `-g` rather than `-j`.
    pub goto: bool,
    pub name: String,
    pub opts: Vec<Opt>,
}

impl Target {
    pub fn opt(&self, name: &str) -> Option<&Opt> {
        self.opts.iter().find(|o| o.name == name)
    }
}

impl SaveFile {
    pub fn table(&self, name: &str) -> Option<&Table> {
        self.tables.iter().find(|t| t.name == name)
    }

    pub fn rule_count(&self) -> usize {
        self.tables
            .iter()
            .flat_map(|t| &t.chains)
            .map(|c| c.rules.len())
            .sum()
    }
}

impl Table {
    pub fn chain(&self, name: &str) -> Option<&Chain> {
        self.chains.iter().find(|c| c.name == name)
    }
}

const BUILTIN: &[&str] = &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// True for the chain names the kernel creates in every table that has them.
pub fn is_builtin_chain(name: &str) -> bool {
    BUILTIN.contains(&name)
}

#[derive(Debug, Clone)]
struct Tok {
    text: String,
    col: usize,
    quoted: bool,
}

/// Splits a line into words the way iptables-restore does: whitespace separated, with double
/// quotes grouping words and `\"` / `\\` escapes inside quotes.
fn tokenize(line: &str, lineno: usize) -> Result<Vec<Tok>, ParseError> {
    let mut out = Vec::new();
    let mut chars = line.char_indices().peekable();
    while let Some(&(i, c)) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let col = line[..i].chars().count() + 1;
        let mut text = String::new();
        let mut quoted = false;
        while let Some(&(_, c)) = chars.peek() {
            if c.is_whitespace() {
                break;
            }
            chars.next();
            if c == '"' {
                quoted = true;
                let mut closed = false;
                while let Some((_, c)) = chars.next() {
                    match c {
                        '"' => {
                            closed = true;
                            break;
                        }
                        '\\' => match chars.next() {
                            Some((_, e)) => text.push(e),
                            None => break,
                        },
                        _ => text.push(c),
                    }
                }
                if !closed {
                    return Err(ParseError::new(lineno, col, "unterminated quote"));
                }
            } else {
                text.push(c);
            }
        }
        out.push(Tok { text, col, quoted });
    }
    Ok(out)
}

fn parse_counters(s: &str) -> Option<Counters> {
    let inner = s.strip_prefix('[')?.strip_suffix(']')?;
    let (p, b) = inner.split_once(':')?;
    Some(Counters {
        packets: p.parse().ok()?,
        bytes: b.parse().ok()?,
    })
}

fn is_option_word(t: &Tok) -> bool {
    !t.quoted && t.text.starts_with('-') && t.text.len() > 1
}

/// Parses a whole `iptables-save` dump. Lenient where real-world fragments are incomplete
/// (missing `:CHAIN` declarations or a final `COMMIT`), strict about syntax it cannot read.
pub fn parse_save(text: &str) -> Result<SaveFile, ParseError> {
    let mut file = SaveFile::default();
    let mut current: Option<Table> = None;
    // Chain name -> position in the current table; kube-proxy dumps have tens of thousands.
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut last_line = 0;
    for (idx, raw_line) in text.lines().enumerate() {
        let lineno = idx + 1;
        last_line = lineno;
        let line = raw_line.trim_end_matches('\r');
        let trimmed = line.trim_start();
        let indent = line.chars().count() - trimmed.chars().count();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if let Some(name) = trimmed.strip_prefix('*') {
            if let Some(t) = current.take() {
                file.tables.push(t);
            }
            let name = name.trim();
            if name.is_empty() || name.contains(char::is_whitespace) {
                return Err(ParseError::new(lineno, indent + 2, "bad table name"));
            }
            current = Some(Table {
                name: name.to_string(),
                chains: Vec::new(),
            });
            index.clear();
            continue;
        }
        if trimmed == "COMMIT" {
            match current.take() {
                Some(t) => file.tables.push(t),
                None => {
                    return Err(ParseError::new(
                        lineno,
                        indent + 1,
                        "COMMIT outside a table",
                    ));
                }
            }
            continue;
        }
        let Some(table) = current.as_mut() else {
            return Err(ParseError::new(
                lineno,
                indent + 1,
                "line outside a table (expected `*raw`, `*mangle`, `*nat`, `*filter` or `*security` first)",
            ));
        };
        if let Some(decl) = trimmed.strip_prefix(':') {
            let toks = tokenize(decl, lineno)?;
            let Some(name) = toks.first() else {
                return Err(ParseError::new(lineno, indent + 2, "missing chain name"));
            };
            let policy = match toks.get(1) {
                None => None,
                Some(p) if p.text == "-" => None,
                Some(p) => Some(p.text.clone()),
            };
            let counters = match toks.get(2) {
                None => None,
                Some(c) => Some(parse_counters(&c.text).ok_or_else(|| {
                    ParseError::new(
                        lineno,
                        indent + 1 + c.col,
                        "bad counters, expected [pkts:bytes]",
                    )
                })?),
            };
            if let Some(extra) = toks.get(3) {
                return Err(ParseError::new(
                    lineno,
                    indent + 1 + extra.col,
                    "unexpected text after chain counters",
                ));
            }
            match index.get(&name.text) {
                // A rule may have created it before its declaration in hand-written fragments.
                Some(&i) => {
                    let c = &mut table.chains[i];
                    c.policy = policy;
                    c.counters = counters;
                }
                None => {
                    index.insert(name.text.clone(), table.chains.len());
                    table.chains.push(Chain {
                        name: name.text.clone(),
                        policy,
                        counters,
                        rules: Vec::new(),
                    });
                }
            }
            continue;
        }
        let mut toks = tokenize(line, lineno)?;
        let mut counters = None;
        if toks.first().is_some_and(|t| t.text.starts_with('[')) {
            let t = toks.remove(0);
            counters = Some(parse_counters(&t.text).ok_or_else(|| {
                ParseError::new(lineno, t.col, "bad counters, expected [pkts:bytes]")
            })?);
        }
        let rule = parse_rule_tokens(&toks, counters, lineno)?;
        let chain = match index.get(&rule.chain) {
            Some(&i) => &mut table.chains[i],
            None => {
                index.insert(rule.chain.clone(), table.chains.len());
                let policy = is_builtin_chain(&rule.chain).then(|| "ACCEPT".to_string());
                table.chains.push(Chain {
                    name: rule.chain.clone(),
                    policy,
                    counters: None,
                    rules: Vec::new(),
                });
                table.chains.last_mut().expect("just pushed")
            }
        };
        chain.rules.push(rule);
    }
    if let Some(t) = current.take() {
        // iptables-restore would refuse this; we accept it so pasted fragments still explain.
        let _ = last_line;
        file.tables.push(t);
    }
    Ok(file)
}

/// Parses one rule line (`-A CHAIN ...`, without counters).
pub fn parse_rule(line: &str) -> Result<Rule, ParseError> {
    let toks = tokenize(line, 1)?;
    parse_rule_tokens(&toks, None, 1)
}

fn parse_rule_tokens(
    toks: &[Tok],
    counters: Option<Counters>,
    lineno: usize,
) -> Result<Rule, ParseError> {
    let err = |t: &Tok, m: String| ParseError::new(lineno, t.col, m);
    let end_col = toks.last().map_or(1, |t| t.col + t.text.chars().count());
    let mut it = 0usize;
    let first = toks
        .first()
        .ok_or_else(|| ParseError::new(lineno, 1, "empty rule"))?;
    if first.text != "-A" && first.text != "--append" {
        return Err(err(
            first,
            format!("expected `-A CHAIN`, found `{}`", first.text),
        ));
    }
    it += 1;
    let chain = toks
        .get(it)
        .filter(|t| !is_option_word(t))
        .ok_or_else(|| ParseError::new(lineno, end_col, "missing chain name after -A"))?
        .text
        .clone();
    it += 1;
    let mut items: Vec<Item> = Vec::new();
    let mut target: Option<Target> = None;
    let mut neg = false;
    let mut neg_tok: Option<&Tok> = None;
    let mut proto: Option<String> = None;
    while let Some(t) = toks.get(it) {
        it += 1;
        if t.text == "!" && !t.quoted {
            if neg {
                return Err(err(t, "double negation".into()));
            }
            neg = true;
            neg_tok = Some(t);
            continue;
        }
        if !is_option_word(t) {
            return Err(err(
                t,
                format!("unexpected `{}` (expected an option)", t.text),
            ));
        }
        let basic = match t.text.as_str() {
            "-s" | "--source" | "--src" => Some(Basic::Src),
            "-d" | "--destination" | "--dst" => Some(Basic::Dst),
            "-p" | "--protocol" => Some(Basic::Proto),
            "-i" | "--in-interface" => Some(Basic::InIface),
            "-o" | "--out-interface" => Some(Basic::OutIface),
            _ => None,
        };
        if let Some(kind) = basic {
            if target.is_some() {
                return Err(err(t, format!("`{}` after the target", t.text)));
            }
            let v = toks
                .get(it)
                .filter(|v| !is_option_word(v) && v.text != "!")
                .ok_or_else(|| err(t, format!("`{}` needs a value", t.text)))?;
            it += 1;
            if kind == Basic::Proto {
                proto = Some(v.text.to_ascii_lowercase());
            }
            items.push(Item::Basic {
                neg,
                kind,
                value: v.text.clone(),
            });
            neg = false;
            continue;
        }
        match t.text.as_str() {
            "-f" | "--fragment" => {
                items.push(Item::Fragment { neg });
                neg = false;
            }
            "-m" | "--match" => {
                if neg {
                    return Err(err(neg_tok.unwrap_or(t), "`!` cannot negate -m".into()));
                }
                if target.is_some() {
                    return Err(err(t, "-m after the target".into()));
                }
                let name = toks
                    .get(it)
                    .filter(|v| !is_option_word(v))
                    .ok_or_else(|| err(t, "-m needs a module name".into()))?;
                it += 1;
                items.push(Item::Module {
                    name: name.text.clone(),
                    implicit: false,
                    opts: Vec::new(),
                });
            }
            "-j" | "--jump" | "-g" | "--goto" => {
                if neg {
                    return Err(err(
                        neg_tok.unwrap_or(t),
                        "`!` cannot negate a target".into(),
                    ));
                }
                if target.is_some() {
                    return Err(err(t, "second target".into()));
                }
                let name = toks
                    .get(it)
                    .filter(|v| !is_option_word(v) && v.text != "!")
                    .ok_or_else(|| err(t, format!("`{}` needs a target or chain", t.text)))?;
                it += 1;
                target = Some(Target {
                    goto: t.text.starts_with("-g") || t.text == "--goto",
                    name: name.text.clone(),
                    opts: Vec::new(),
                });
            }
            other if other.starts_with("--") => {
                let mut args = Vec::new();
                while let Some(a) = toks.get(it) {
                    if is_option_word(a) || (a.text == "!" && !a.quoted) {
                        break;
                    }
                    args.push(a.text.clone());
                    it += 1;
                }
                let opt = Opt {
                    neg,
                    name: other[2..].to_string(),
                    args,
                };
                neg = false;
                if let Some(tg) = target.as_mut() {
                    tg.opts.push(opt);
                } else if let Some(Item::Module { opts, .. }) = items.last_mut() {
                    opts.push(opt);
                } else if let Some(p) = proto.clone() {
                    // `-p tcp --dport 22` loads the protocol's match implicitly.
                    items.push(Item::Module {
                        name: p,
                        implicit: true,
                        opts: vec![opt],
                    });
                } else {
                    return Err(err(
                        t,
                        format!("option `{other}` without a match (-m) or target (-j)"),
                    ));
                }
            }
            other => return Err(err(t, format!("unknown option `{other}`"))),
        }
    }
    if neg {
        return Err(err(
            neg_tok.expect("set with neg"),
            "`!` at end of rule".into(),
        ));
    }
    Ok(Rule {
        chain,
        counters,
        items,
        target,
    })
}

fn force_quote(s: &str) -> String {
    let mut q = String::from("\"");
    for c in s.chars() {
        if c == '"' || c == '\\' {
            q.push('\\');
        }
        q.push(c);
    }
    q.push('"');
    q
}

/// Quotes a word when the parser would otherwise split it or read it as an option or `!`.
fn quote(s: &str) -> String {
    if !s.is_empty()
        && !s.starts_with('-')
        && !s
            .chars()
            .any(|c| c.is_whitespace() || c == '"' || c == '\\')
        && s != "!"
    {
        return s.to_string();
    }
    force_quote(s)
}

fn push_opts(out: &mut String, opts: &[Opt]) {
    for o in opts {
        if o.neg {
            out.push_str(" !");
        }
        out.push_str(" --");
        out.push_str(&o.name);
        // iptables-save prints free-text options through xtables_save_string, which always
        // quotes; doing the same keeps `text()` identical to the dump's line.
        let always = matches!(o.name.as_str(), "comment" | "log-prefix" | "nflog-prefix");
        for a in &o.args {
            out.push(' ');
            out.push_str(&if always { force_quote(a) } else { quote(a) });
        }
    }
}

impl Rule {
    /// The rule as `iptables-save` prints it, without counters: `-A CHAIN ...`.
    pub fn text(&self) -> String {
        let mut out = format!("-A {}", quote(&self.chain));
        for item in &self.items {
            match item {
                Item::Basic { neg, kind, value } => {
                    if *neg {
                        out.push_str(" !");
                    }
                    out.push(' ');
                    out.push_str(kind.flag());
                    out.push(' ');
                    out.push_str(&quote(value));
                }
                Item::Fragment { neg } => out.push_str(if *neg { " ! -f" } else { " -f" }),
                Item::Module {
                    name,
                    implicit,
                    opts,
                } => {
                    if !implicit {
                        out.push_str(" -m ");
                        out.push_str(&quote(name));
                    }
                    push_opts(&mut out, opts);
                }
            }
        }
        if let Some(t) = &self.target {
            out.push_str(if t.goto { " -g " } else { " -j " });
            out.push_str(&quote(&t.name));
            push_opts(&mut out, &t.opts);
        }
        out
    }

    /// All `--comment` texts, in order.
    pub fn comments(&self) -> Vec<&str> {
        let mut out = Vec::new();
        for item in &self.items {
            if let Item::Module { name, opts, .. } = item
                && name == "comment"
            {
                for o in opts {
                    if o.name == "comment"
                        && let Some(a) = o.args.first()
                    {
                        out.push(a.as_str());
                    }
                }
            }
        }
        out
    }
}

impl SaveFile {
    /// Prints the dump in `iptables-save` form; `with_counters` adds the `-c` prefixes.
    pub fn to_text(&self, with_counters: bool) -> String {
        let mut out = String::new();
        for t in &self.tables {
            out.push('*');
            out.push_str(&t.name);
            out.push('\n');
            for c in &t.chains {
                out.push(':');
                out.push_str(&quote(&c.name));
                out.push(' ');
                out.push_str(&c.policy.as_deref().map_or_else(|| "-".to_string(), quote));
                if let Some(k) = c.counters {
                    out.push_str(&format!(" [{}:{}]", k.packets, k.bytes));
                }
                out.push('\n');
            }
            for c in &t.chains {
                for r in &c.rules {
                    if with_counters && let Some(k) = r.counters {
                        out.push_str(&format!("[{}:{}] ", k.packets, k.bytes));
                    }
                    out.push_str(&r.text());
                    out.push('\n');
                }
            }
            out.push_str("COMMIT\n");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counters_comments_negation_and_goto() {
        let text = "# Generated\n*filter\n:INPUT ACCEPT [494:126858]\n:cali-INPUT - [0:0]\n\
            [3:180] -A INPUT -m comment --comment \"cali:Cz_u1IQiXIMmKD4c\" -j cali-INPUT\n\
            -A cali-INPUT ! -i cali+ -m mark ! --mark 0x0/0xfff00000 -g cali-wl-to-host\nCOMMIT\n";
        let f = parse_save(text).unwrap();
        let t = f.table("filter").unwrap();
        let input = t.chain("INPUT").unwrap();
        assert_eq!(input.policy.as_deref(), Some("ACCEPT"));
        assert_eq!(
            input.counters,
            Some(Counters {
                packets: 494,
                bytes: 126858
            })
        );
        assert_eq!(
            input.rules[0].counters,
            Some(Counters {
                packets: 3,
                bytes: 180
            })
        );
        assert_eq!(input.rules[0].comments(), vec!["cali:Cz_u1IQiXIMmKD4c"]);
        let r = &t.chain("cali-INPUT").unwrap().rules[0];
        assert!(r.target.as_ref().unwrap().goto);
        assert_eq!(
            r.items[0],
            Item::Basic {
                neg: true,
                kind: Basic::InIface,
                value: "cali+".into()
            }
        );
        let Item::Module { opts, .. } = &r.items[1] else {
            panic!("module expected")
        };
        assert!(opts[0].neg);
        assert_eq!(
            r.text(),
            "-A cali-INPUT ! -i cali+ -m mark ! --mark 0x0/0xfff00000 -g cali-wl-to-host"
        );
    }

    #[test]
    fn implicit_protocol_match_and_long_options() {
        let r = parse_rule("--append X --protocol tcp --dport 22 --jump ACCEPT").unwrap();
        assert_eq!(r.text(), "-A X -p tcp --dport 22 -j ACCEPT");
        assert_eq!(parse_rule(&r.text()).unwrap(), r);
    }

    #[test]
    fn quoted_escapes_round_trip() {
        let r = parse_rule(
            r#"-A X -m comment --comment "a \"quoted\" \\ word" -j LOG --log-prefix "p: ""#,
        )
        .unwrap();
        assert_eq!(r.comments(), vec![r#"a "quoted" \ word"#]);
        assert_eq!(parse_rule(&r.text()).unwrap(), r);
    }

    #[test]
    fn errors_carry_line_and_column() {
        let e = parse_save("*nat\n-A X -m comment --comment \"open\n").unwrap_err();
        assert_eq!((e.line, e.column), (2, 27));
        let e = parse_save("-A X -j ACCEPT\n").unwrap_err();
        assert_eq!(e.line, 1);
        let e = parse_save("*nat\n-A X -s\n").unwrap_err();
        assert_eq!((e.line, e.column), (2, 6));
        let e = parse_save("*nat\n-A X --dport 22\n").unwrap_err();
        assert!(e.message.contains("without a match"), "{e}");
        let e = parse_save("*nat\n[1:x] -A X\n").unwrap_err();
        assert_eq!((e.line, e.column), (2, 1));
        let e = parse_save("*nat\n-A X ! ! -s 1.2.3.4\n").unwrap_err();
        assert_eq!((e.line, e.column), (2, 8));
        assert!(parse_save("*nat\n-A X -j\n").is_err());
        assert!(parse_save("*nat\n-A X -j A -j B\n").is_err());
        assert!(parse_save("COMMIT\n").is_err());
        assert!(parse_save("*nat\n:X - [1:2] junk\n").is_err());
    }

    #[test]
    fn fragments_without_declarations_create_chains() {
        let f = parse_save("*nat\n-A POSTROUTING -j MASQUERADE\n-A cali-x -j RETURN\n").unwrap();
        let t = f.table("nat").unwrap();
        assert_eq!(
            t.chain("POSTROUTING").unwrap().policy.as_deref(),
            Some("ACCEPT")
        );
        assert_eq!(t.chain("cali-x").unwrap().policy, None);
    }

    #[test]
    fn rule_without_target_is_kept() {
        let r = parse_rule("-A X -s 10.0.0.0/8").unwrap();
        assert!(r.target.is_none());
        assert_eq!(r.text(), "-A X -s 10.0.0.0/8");
    }
}
