//! The model of an `iptables-save` dump: tables, chains and rules kept as the ordered list
//! of their parts (counters, comments, negation, goto), and the printer whose output
//! `crate::iptables` parses back to the same model. Both the parser and the checks of
//! `crate::check` use it; neither is needed to hold or print a ruleset.

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

fn force_quote(s: &str) -> String {
    let mut q = String::from("\"");
    // Only an unterminated quote at the end of a line yields a trailing newline; print it
    // the same way so the text reads back to the same word.
    let (body, open) = match s.strip_suffix('\n') {
        Some(b) => (b, true),
        None => (s, false),
    };
    for c in body.chars() {
        if c == '"' || c == '\\' {
            q.push('\\');
        }
        q.push(c);
    }
    if !open {
        q.push('"');
    }
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
                // Declarations are split on whitespace, not quotes: print them raw.
                out.push(':');
                out.push_str(&c.name);
                out.push(' ');
                out.push_str(c.policy.as_deref().unwrap_or("-"));
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
