//! The check language: one comparison between two arithmetic sides over metric series, e.g.
//!
//! ```text
//! mean(rollout/raw_reward, last=10) >= bf16 - 0.05
//! max(train/train_rollout_kl) < 3e-3
//! spikes(site="*experts*") <= 2
//! contract_violations == 0
//! ```
//!
//! A check is evaluated once per configuration. Every function works per seed and then combines the
//! seeds (`over=`): `mean` across seeds by default, except `max` (worst seed: max), `min` (min), and
//! the counts `spikes`, `events`, `contract_violations` (sum over seeds). A bare configuration name
//! (or `baseline`) stands for the other side's function evaluated on that configuration, so
//! `mean(rollout/raw_reward, last=10) >= bf16 - 0.05` reads "within 0.05 of BF16's value".
//! Division needs spaces around `/`: inside a name `/` belongs to the metric key.
//!
//! Errors carry the byte offset into the expression, so `suite check` can point at the bad token.

use std::fmt;

/// A parse or evaluation error with its byte position in the expression.
#[derive(Debug, Clone, PartialEq)]
pub struct ExprError {
    pub pos: usize,
    pub msg: String,
}

impl ExprError {
    fn at(pos: usize, msg: impl Into<String>) -> ExprError {
        ExprError {
            pos,
            msg: msg.into(),
        }
    }

    /// The expression with a caret under the error position, for terminal output.
    pub fn render(&self, expr: &str) -> String {
        let col = expr[..self.pos.min(expr.len())].chars().count();
        format!(
            "at byte {}: {}\n    {expr}\n    {}^",
            self.pos,
            self.msg,
            " ".repeat(col)
        )
    }
}

impl fmt::Display for ExprError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "at byte {}: {}", self.pos, self.msg)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Num(f64),
    Ident(String),
    Str(String),
    Op(&'static str),
    LParen,
    RParen,
    Comma,
    Assign,
    End,
}

#[derive(Debug, Clone, PartialEq)]
struct Token {
    tok: Tok,
    start: usize,
    end: usize,
}

fn is_ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_'
}

fn is_ident_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'/')
}

/// Split an expression into tokens with byte ranges.
fn tokenize(s: &str) -> Result<Vec<Token>, ExprError> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let start = i;
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let tok =
            if c.is_ascii_digit() || (c == b'.' && b.get(i + 1).is_some_and(u8::is_ascii_digit)) {
                while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') {
                    i += 1;
                }
                if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
                    let mut j = i + 1;
                    if j < b.len() && (b[j] == b'+' || b[j] == b'-') {
                        j += 1;
                    }
                    if j < b.len() && b[j].is_ascii_digit() {
                        i = j;
                        while i < b.len() && b[i].is_ascii_digit() {
                            i += 1;
                        }
                    }
                }
                if i < b.len() && is_ident_start(b[i]) {
                    return Err(ExprError::at(
                        i,
                        "a number runs into a name; put a space or an operator between them",
                    ));
                }
                let text = &s[start..i];
                Tok::Num(
                    text.parse()
                        .map_err(|_| ExprError::at(start, format!("`{text}` is not a number")))?,
                )
            } else if is_ident_start(c) {
                while i < b.len() && is_ident_char(b[i]) {
                    i += 1;
                }
                if s[start..i].ends_with('/') {
                    return Err(ExprError::at(
                        i - 1,
                        "a name cannot end in `/` (write division with spaces: `a / b`)",
                    ));
                }
                Tok::Ident(s[start..i].to_string())
            } else if c == b'"' || c == b'\'' {
                i += 1;
                while i < b.len() && b[i] != c {
                    i += 1;
                }
                if i >= b.len() {
                    return Err(ExprError::at(start, "unterminated string"));
                }
                i += 1;
                Tok::Str(s[start + 1..i - 1].to_string())
            } else {
                let two = s.get(i..i + 2).unwrap_or("");
                let (tok, len) = match two {
                    "<=" => (Tok::Op("<="), 2),
                    ">=" => (Tok::Op(">="), 2),
                    "==" => (Tok::Op("=="), 2),
                    "!=" => (Tok::Op("!="), 2),
                    _ => match c {
                        b'<' => (Tok::Op("<"), 1),
                        b'>' => (Tok::Op(">"), 1),
                        b'+' => (Tok::Op("+"), 1),
                        b'-' => (Tok::Op("-"), 1),
                        b'*' => (Tok::Op("*"), 1),
                        b'/' => (Tok::Op("/"), 1),
                        b'(' => (Tok::LParen, 1),
                        b')' => (Tok::RParen, 1),
                        b',' => (Tok::Comma, 1),
                        b'=' => (Tok::Assign, 1),
                        _ => {
                            let ch = s[i..].chars().next().unwrap_or('?');
                            return Err(ExprError::at(i, format!("unexpected character `{ch}`")));
                        }
                    },
                };
                i += len;
                tok
            };
        out.push(Token { tok, start, end: i });
    }
    out.push(Token {
        tok: Tok::End,
        start: s.len(),
        end: s.len(),
    });
    Ok(out)
}

/// How the per-seed values of a function are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    Mean,
    Median,
    Min,
    Max,
    Sum,
}

/// The functions the language knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Func {
    Mean,
    Median,
    Min,
    Max,
    First,
    Last,
    Iqm,
    Std,
    Slope,
    RatioAbove,
    RatioBelow,
    Spikes,
    Events,
    ContractViolations,
}

const FUNCS: [(&str, Func); 14] = [
    ("mean", Func::Mean),
    ("median", Func::Median),
    ("min", Func::Min),
    ("max", Func::Max),
    ("first", Func::First),
    ("last", Func::Last),
    ("iqm", Func::Iqm),
    ("std", Func::Std),
    ("slope", Func::Slope),
    ("ratio_above", Func::RatioAbove),
    ("ratio_below", Func::RatioBelow),
    ("spikes", Func::Spikes),
    ("events", Func::Events),
    ("contract_violations", Func::ContractViolations),
];

impl Func {
    /// Whether the first argument is a metric series.
    fn takes_metric(self) -> bool {
        !matches!(self, Func::Spikes | Func::Events | Func::ContractViolations)
    }
    fn default_over(self) -> Over {
        match self {
            Func::Max => Over::Max,
            Func::Min => Over::Min,
            Func::Spikes | Func::Events | Func::ContractViolations => Over::Sum,
            _ => Over::Mean,
        }
    }
    fn allowed_args(self) -> &'static [&'static str] {
        match self {
            Func::Spikes => &["site", "layer", "config", "over"],
            Func::Events => &["kind", "site", "config", "over"],
            Func::ContractViolations => &["config", "over"],
            Func::RatioAbove | Func::RatioBelow => {
                &["last", "first", "start", "end", "config", "over"]
            }
            _ => &["last", "first", "start", "end", "config", "over"],
        }
    }
}

/// A function call with its arguments resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub func: Func,
    pub metric: Option<String>,
    /// The threshold of `ratio_above`/`ratio_below` (second positional argument).
    pub threshold: Option<f64>,
    /// Keep only the last / first N points of each seed's series.
    pub last: Option<usize>,
    pub first: Option<usize>,
    /// Keep steps in `start..end` (end exclusive).
    pub start: Option<usize>,
    pub end: Option<usize>,
    pub over: Over,
    /// Evaluate on this configuration instead of the one under check.
    pub config: Option<String>,
    pub site: Option<String>,
    pub layer: Option<i64>,
    pub kind: Option<String>,
    pub pos: usize,
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    Num(f64),
    Neg(Box<Node>),
    Bin(char, Box<Node>, Box<Node>),
    Call(Call),
    /// A constant set in the suite (e.g. `margin`).
    Const(String),
    /// A configuration name: the other side's call, on that configuration.
    ConfigRef(String, usize),
}

/// A parsed check.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub text: String,
    lhs: Node,
    op: &'static str,
    rhs: Node,
}

/// What names mean while parsing: the suite's configurations and constants.
#[derive(Debug, Clone, Default)]
pub struct Names {
    pub configs: Vec<String>,
    /// The configuration `baseline` refers to.
    pub baseline: String,
    pub constants: Vec<(String, f64)>,
}

struct Parser<'a> {
    toks: Vec<Token>,
    i: usize,
    names: &'a Names,
    /// Current nesting (parentheses and unary signs), bounded by [`MAX_DEPTH`].
    depth: usize,
}

/// Deepest nesting of parentheses and signs a check may use. The parser and the evaluator recurse
/// once per level, so without a bound a hostile check overflows the stack (an abort, not an error).
pub const MAX_DEPTH: usize = 64;

/// Most tokens a check may have: a long chain `a + a + ...` nests as deep as it is long.
pub const MAX_TOKENS: usize = 512;

/// Parse a check against the suite's names.
pub fn parse(text: &str, names: &Names) -> Result<Check, ExprError> {
    let toks = tokenize(text)?;
    if toks.len() > MAX_TOKENS {
        return Err(ExprError::at(
            toks[MAX_TOKENS].start,
            format!(
                "check has {} tokens, at most {MAX_TOKENS} are allowed; split it into several checks",
                toks.len()
            ),
        ));
    }
    let mut p = Parser {
        toks,
        i: 0,
        names,
        depth: 0,
    };
    let lhs = p.sum()?;
    let t = p.next();
    let op = match t.tok {
        Tok::Op(o @ ("<" | "<=" | ">" | ">=" | "==" | "!=")) => o,
        Tok::End => {
            return Err(ExprError::at(
                t.start,
                "a check needs a comparison (<, <=, >, >=, ==, !=)",
            ));
        }
        _ => {
            return Err(ExprError::at(
                t.start,
                "expected a comparison (<, <=, >, >=, ==, !=)",
            ));
        }
    };
    let rhs = p.sum()?;
    let t = p.next();
    if t.tok != Tok::End {
        return Err(ExprError::at(
            t.start,
            "unexpected text after the check (one comparison per check)",
        ));
    }
    for (side, other) in [(&lhs, &rhs), (&rhs, &lhs)] {
        if let Some(pos) = config_ref_pos(side) {
            let calls = count_calls(other);
            if calls != 1 {
                return Err(ExprError::at(
                    pos,
                    format!(
                        "a configuration name stands for the other side's function on that configuration, but the other side has {calls} function calls; write e.g. mean(METRIC, config=\"bf16\")"
                    ),
                ));
            }
        }
    }
    Ok(Check {
        text: text.to_string(),
        lhs,
        op,
        rhs,
    })
}

fn config_ref_pos(n: &Node) -> Option<usize> {
    match n {
        Node::ConfigRef(_, p) => Some(*p),
        Node::Neg(a) => config_ref_pos(a),
        Node::Bin(_, a, b) => config_ref_pos(a).or_else(|| config_ref_pos(b)),
        _ => None,
    }
}

fn count_calls(n: &Node) -> usize {
    match n {
        Node::Call(_) => 1,
        Node::Neg(a) => count_calls(a),
        Node::Bin(_, a, b) => count_calls(a) + count_calls(b),
        _ => 0,
    }
}

fn first_call(n: &Node) -> Option<&Call> {
    match n {
        Node::Call(c) => Some(c),
        Node::Neg(a) => first_call(a),
        Node::Bin(_, a, b) => first_call(a).or_else(|| first_call(b)),
        _ => None,
    }
}

impl Parser<'_> {
    fn peek(&self) -> &Token {
        &self.toks[self.i]
    }
    fn next(&mut self) -> Token {
        let t = self.toks[self.i].clone();
        if self.i + 1 < self.toks.len() {
            self.i += 1;
        }
        t
    }

    fn sum(&mut self) -> Result<Node, ExprError> {
        let mut n = self.product()?;
        while let Tok::Op(o @ ("+" | "-")) = self.peek().tok {
            self.next();
            let r = self.product()?;
            n = Node::Bin(o.chars().next().unwrap_or('+'), Box::new(n), Box::new(r));
        }
        Ok(n)
    }

    fn product(&mut self) -> Result<Node, ExprError> {
        let mut n = self.unary()?;
        while let Tok::Op(o @ ("*" | "/")) = self.peek().tok {
            self.next();
            let r = self.unary()?;
            n = Node::Bin(o.chars().next().unwrap_or('*'), Box::new(n), Box::new(r));
        }
        Ok(n)
    }

    fn unary(&mut self) -> Result<Node, ExprError> {
        if self.depth >= MAX_DEPTH {
            return Err(ExprError::at(
                self.peek().start,
                format!(
                    "nested more than {MAX_DEPTH} levels deep (parentheses or signs); simplify the check"
                ),
            ));
        }
        self.depth += 1;
        let n = self.unary_inner();
        self.depth -= 1;
        n
    }

    fn unary_inner(&mut self) -> Result<Node, ExprError> {
        if self.peek().tok == Tok::Op("-") {
            self.next();
            return Ok(Node::Neg(Box::new(self.unary()?)));
        }
        self.atom()
    }

    fn atom(&mut self) -> Result<Node, ExprError> {
        let t = self.next();
        match t.tok {
            Tok::Num(v) => Ok(Node::Num(v)),
            Tok::LParen => {
                let n = self.sum()?;
                let c = self.next();
                if c.tok != Tok::RParen {
                    return Err(ExprError::at(c.start, "expected `)`"));
                }
                Ok(n)
            }
            Tok::Ident(name) => {
                if self.peek().tok == Tok::LParen {
                    self.next();
                    return self.call(&name, t.start).map(Node::Call);
                }
                self.name(&name, t.start)
            }
            Tok::End => Err(ExprError::at(
                t.start,
                "expression ends too early: expected a value",
            )),
            _ => Err(ExprError::at(
                t.start,
                "expected a number, a function call or a name",
            )),
        }
    }

    /// A bare name: a constant, a configuration, or an argument-less count.
    fn name(&mut self, name: &str, pos: usize) -> Result<Node, ExprError> {
        if name == "contract_violations" {
            return Ok(Node::Call(Call::new(Func::ContractViolations, pos)));
        }
        if name == "spikes" {
            return Ok(Node::Call(Call::new(Func::Spikes, pos)));
        }
        if self.names.constants.iter().any(|(k, _)| k == name) {
            return Ok(Node::Const(name.to_string()));
        }
        if name == "baseline" {
            return Ok(Node::ConfigRef(self.names.baseline.clone(), pos));
        }
        if self.names.configs.iter().any(|c| c == name) {
            return Ok(Node::ConfigRef(name.to_string(), pos));
        }
        let mut known: Vec<&str> = self.names.configs.iter().map(String::as_str).collect();
        known.extend(self.names.constants.iter().map(|(k, _)| k.as_str()));
        known.extend(["baseline", "contract_violations", "spikes"]);
        known.extend(FUNCS.iter().map(|(n, _)| *n));
        let hint = crate::recipe::presets::suggest(name, &known)
            .map(|s| format!(" (did you mean `{s}`?)"))
            .unwrap_or_default();
        let what = if name.contains('/') {
            format!("`{name}` looks like a metric: use it inside a function, e.g. mean({name})")
        } else {
            format!(
                "unknown name `{name}`{hint}: use a configuration ({}), `baseline`, a constant, or a function call",
                self.names.configs.join(", ")
            )
        };
        Err(ExprError::at(pos, what))
    }

    fn call(&mut self, name: &str, pos: usize) -> Result<Call, ExprError> {
        let Some(func) = FUNCS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f) else {
            let names: Vec<&str> = FUNCS.iter().map(|(n, _)| *n).collect();
            let hint = crate::recipe::presets::suggest(name, &names)
                .map(|s| format!(" (did you mean `{s}`?)"))
                .unwrap_or_default();
            return Err(ExprError::at(
                pos,
                format!(
                    "unknown function `{name}`{hint}; known: {}",
                    names.join(", ")
                ),
            ));
        };
        let mut c = Call::new(func, pos);
        let mut positional = 0;
        if self.peek().tok == Tok::RParen {
            self.next();
        } else {
            loop {
                let t = self.next();
                let named = matches!(t.tok, Tok::Ident(_)) && self.peek().tok == Tok::Assign;
                if named {
                    let Tok::Ident(key) = t.tok else {
                        unreachable!("checked above")
                    };
                    self.next();
                    let v = self.next();
                    self.named_arg(&mut c, &key, t.start, v)?;
                } else {
                    self.positional_arg(&mut c, positional, t)?;
                    positional += 1;
                }
                let sep = self.next();
                match sep.tok {
                    Tok::Comma => continue,
                    Tok::RParen => break,
                    _ => return Err(ExprError::at(sep.start, "expected `,` or `)`")),
                }
            }
        }
        if func.takes_metric() && c.metric.is_none() {
            return Err(ExprError::at(
                pos,
                format!(
                    "`{name}` needs a metric as its first argument, e.g. {name}(rollout/raw_reward)"
                ),
            ));
        }
        if matches!(func, Func::RatioAbove | Func::RatioBelow) && c.threshold.is_none() {
            return Err(ExprError::at(
                pos,
                format!("`{name}` needs a threshold: {name}(METRIC, 0.5)"),
            ));
        }
        if c.last.is_some() && c.first.is_some() {
            return Err(ExprError::at(pos, "use `last=` or `first=`, not both"));
        }
        Ok(c)
    }

    fn positional_arg(&mut self, c: &mut Call, k: usize, t: Token) -> Result<(), ExprError> {
        match (k, &t.tok) {
            (0, Tok::Ident(m)) if c.func.takes_metric() => {
                c.metric = Some(m.clone());
                Ok(())
            }
            (0, Tok::Str(m)) if c.func.takes_metric() => {
                c.metric = Some(m.clone());
                Ok(())
            }
            (1, Tok::Num(v)) if matches!(c.func, Func::RatioAbove | Func::RatioBelow) => {
                c.threshold = Some(*v);
                Ok(())
            }
            (1, Tok::Op("-")) if matches!(c.func, Func::RatioAbove | Func::RatioBelow) => {
                match self.next().tok {
                    Tok::Num(v) => {
                        c.threshold = Some(-v);
                        Ok(())
                    }
                    _ => Err(ExprError::at(t.end, "expected a number")),
                }
            }
            _ => Err(ExprError::at(
                t.start,
                format!(
                    "unexpected argument; this function takes {}named arguments {}",
                    if c.func.takes_metric() {
                        "a metric, then "
                    } else {
                        "only "
                    },
                    c.func.allowed_args().join("=, ") + "="
                ),
            )),
        }
    }

    fn named_arg(
        &mut self,
        c: &mut Call,
        key: &str,
        pos: usize,
        v: Token,
    ) -> Result<(), ExprError> {
        let allowed = c.func.allowed_args();
        if !allowed.contains(&key) {
            let hint = crate::recipe::presets::suggest(key, allowed)
                .map(|s| format!(" (did you mean `{s}`?)"))
                .unwrap_or_default();
            return Err(ExprError::at(
                pos,
                format!(
                    "unknown argument `{key}`{hint}; allowed: {}",
                    allowed.join(", ")
                ),
            ));
        }
        let count = |v: &Token| match v.tok {
            Tok::Num(x) if x >= 0.0 && x.fract() == 0.0 => Ok(x as usize),
            _ => Err(ExprError::at(
                v.start,
                format!("`{key}` takes a whole number >= 0"),
            )),
        };
        let text = |v: &Token| match &v.tok {
            Tok::Str(s) | Tok::Ident(s) => Ok(s.clone()),
            _ => Err(ExprError::at(
                v.start,
                format!("`{key}` takes a quoted string"),
            )),
        };
        match key {
            "last" => c.last = Some(count(&v)?),
            "first" => c.first = Some(count(&v)?),
            "start" => c.start = Some(count(&v)?),
            "end" => c.end = Some(count(&v)?),
            "layer" => {
                let neg = v.tok == Tok::Op("-");
                let v = if neg { self.next() } else { v };
                let n = count(&v)? as i64;
                c.layer = Some(if neg { -n } else { n });
            }
            "site" => {
                let s = text(&v)?;
                crate::recipe::glob_matcher(&s)
                    .map_err(|e| ExprError::at(v.start, format!("bad site pattern: {e}")))?;
                c.site = Some(s);
            }
            "kind" => c.kind = Some(text(&v)?),
            "config" => {
                let s = text(&v)?;
                let s = if s == "baseline" {
                    self.names.baseline.clone()
                } else {
                    s
                };
                if !self.names.configs.is_empty() && !self.names.configs.contains(&s) {
                    return Err(ExprError::at(
                        v.start,
                        format!(
                            "no configuration `{s}` in this suite (have: {})",
                            self.names.configs.join(", ")
                        ),
                    ));
                }
                c.config = Some(s);
            }
            "over" => {
                c.over = match text(&v)?.as_str() {
                    "mean" => Over::Mean,
                    "median" => Over::Median,
                    "min" => Over::Min,
                    "max" => Over::Max,
                    "sum" => Over::Sum,
                    other => {
                        return Err(ExprError::at(
                            v.start,
                            format!("over=\"{other}\": use mean, median, min, max or sum"),
                        ));
                    }
                }
            }
            _ => unreachable!("allowed_args lists only the keys above"),
        }
        Ok(())
    }
}

impl Call {
    fn new(func: Func, pos: usize) -> Call {
        Call {
            func,
            metric: None,
            threshold: None,
            last: None,
            first: None,
            start: None,
            end: None,
            over: func.default_over(),
            config: None,
            site: None,
            layer: None,
            kind: None,
            pos,
        }
    }
}

/// Where a check's functions get their numbers. Each method returns one value per seed of the
/// configuration (empty when the configuration has no runs).
pub trait Source {
    /// Per seed, the `(step, value)` points of a metric, in step order.
    fn series(&self, config: &str, metric: &str) -> Vec<Vec<(usize, f64)>>;
    /// Per seed, the number of gradient spikes matching the site glob and layer.
    fn spikes(&self, config: &str, site: Option<&str>, layer: Option<i64>) -> Vec<f64>;
    /// Per seed, the number of events of a kind (and site glob).
    fn events(&self, config: &str, kind: Option<&str>, site: Option<&str>) -> Vec<f64>;
    /// Per seed, contract violations.
    fn contract_violations(&self, config: &str) -> Vec<f64>;
}

/// The value of one check on one configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub passed: bool,
    pub lhs: f64,
    pub rhs: f64,
    pub message: String,
}

impl Check {
    /// The metric keys this check reads (so loading can keep only those columns).
    pub fn metrics(&self) -> Vec<String> {
        let mut out = Vec::new();
        collect_metrics(&self.lhs, &mut out);
        collect_metrics(&self.rhs, &mut out);
        out
    }

    /// Evaluate on `config`. A missing metric or configuration fails the check with a message
    /// saying so (a check that cannot be evaluated must never pass).
    pub fn eval(&self, config: &str, src: &dyn Source, constants: &[(String, f64)]) -> Outcome {
        let ctx = Ctx {
            config,
            src,
            constants,
        };
        let l = ctx.node(&self.lhs, &self.rhs);
        let r = ctx.node(&self.rhs, &self.lhs);
        match (l, r) {
            (Ok(l), Ok(r)) => {
                let passed = match self.op {
                    "<" => l < r,
                    "<=" => l <= r,
                    ">" => l > r,
                    ">=" => l >= r,
                    "==" => l == r,
                    _ => l != r,
                };
                let message = if passed {
                    format!(
                        "{config}: {} holds ({} {} {})",
                        self.text,
                        fmt_num(l),
                        self.op,
                        fmt_num(r)
                    )
                } else {
                    format!(
                        "{config}: {} failed: left side is {}, right side is {}",
                        self.text,
                        fmt_num(l),
                        fmt_num(r)
                    )
                };
                Outcome {
                    passed,
                    lhs: l,
                    rhs: r,
                    message,
                }
            }
            (Err(e), _) | (_, Err(e)) => Outcome {
                passed: false,
                lhs: f64::NAN,
                rhs: f64::NAN,
                message: format!("{config}: {} could not be evaluated: {e}", self.text),
            },
        }
    }
}

fn collect_metrics(n: &Node, out: &mut Vec<String>) {
    match n {
        Node::Call(c) => {
            if let Some(m) = &c.metric
                && !out.contains(m)
            {
                out.push(m.clone());
            }
        }
        Node::Neg(a) => collect_metrics(a, out),
        Node::Bin(_, a, b) => {
            collect_metrics(a, out);
            collect_metrics(b, out);
        }
        _ => {}
    }
}

/// Numbers in messages: 4 significant digits, scientific when small or large.
pub fn fmt_num(v: f64) -> String {
    if v == 0.0 || (1e-3..1e5).contains(&v.abs()) {
        let s = format!("{v:.4}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        s.to_string()
    } else {
        format!("{v:.3e}")
    }
}

struct Ctx<'a> {
    config: &'a str,
    src: &'a dyn Source,
    constants: &'a [(String, f64)],
}

impl Ctx<'_> {
    fn node(&self, n: &Node, other: &Node) -> Result<f64, String> {
        Ok(match n {
            Node::Num(v) => *v,
            Node::Neg(a) => -self.node(a, other)?,
            Node::Bin(op, a, b) => {
                let (a, b) = (self.node(a, other)?, self.node(b, other)?);
                match op {
                    '+' => a + b,
                    '-' => a - b,
                    '*' => a * b,
                    _ => a / b,
                }
            }
            Node::Const(k) => self
                .constants
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| *v)
                .ok_or_else(|| format!("constant `{k}` is not set"))?,
            Node::Call(c) => self.call(c, c.config.as_deref().unwrap_or(self.config))?,
            Node::ConfigRef(cfg, _) => {
                let c = first_call(other).ok_or("no function on the other side")?;
                self.call(c, cfg)?
            }
        })
    }

    fn call(&self, c: &Call, config: &str) -> Result<f64, String> {
        let per_seed: Vec<f64> = match c.func {
            Func::Spikes => self.src.spikes(config, c.site.as_deref(), c.layer),
            Func::Events => self
                .src
                .events(config, c.kind.as_deref(), c.site.as_deref()),
            Func::ContractViolations => self.src.contract_violations(config),
            _ => {
                let metric = c.metric.as_deref().unwrap_or_default();
                let series = self.src.series(config, metric);
                if series.is_empty() {
                    return Err(format!("configuration `{config}` has no runs"));
                }
                let mut vals = Vec::with_capacity(series.len());
                for s in &series {
                    let pts = window(s, c);
                    if pts.is_empty() {
                        return Err(format!(
                            "`{metric}` has no values on `{config}` in the selected steps (is the metric logged?)"
                        ));
                    }
                    vals.push(reduce(c, &pts));
                }
                vals
            }
        };
        if per_seed.is_empty() {
            return Err(format!("configuration `{config}` has no runs"));
        }
        Ok(combine(c.over, &per_seed))
    }
}

/// The points of one seed's series a call selects.
fn window(s: &[(usize, f64)], c: &Call) -> Vec<(usize, f64)> {
    let mut pts: Vec<(usize, f64)> = s
        .iter()
        .copied()
        .filter(|(st, v)| {
            v.is_finite() && c.start.is_none_or(|a| *st >= a) && c.end.is_none_or(|b| *st < b)
        })
        .collect();
    if let Some(n) = c.last {
        pts = pts.split_off(pts.len().saturating_sub(n));
    }
    if let Some(n) = c.first {
        pts.truncate(n);
    }
    pts
}

fn reduce(c: &Call, pts: &[(usize, f64)]) -> f64 {
    use super::stats;
    let v: Vec<f64> = pts.iter().map(|p| p.1).collect();
    match c.func {
        Func::Mean => stats::mean(&v),
        Func::Median => stats::median(&v),
        Func::Min => v.iter().copied().fold(f64::INFINITY, f64::min),
        Func::Max => v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        Func::First => v[0],
        Func::Last => v[v.len() - 1],
        Func::Iqm => stats::iqm(&v),
        Func::Std => stats::variance(&v).sqrt(),
        Func::Slope => {
            let x: Vec<f64> = pts.iter().map(|p| p.0 as f64).collect();
            stats::ols_slope(&x, &v)
        }
        Func::RatioAbove => {
            let t = c.threshold.unwrap_or(0.0);
            v.iter().filter(|x| **x > t).count() as f64 / v.len() as f64
        }
        Func::RatioBelow => {
            let t = c.threshold.unwrap_or(0.0);
            v.iter().filter(|x| **x < t).count() as f64 / v.len() as f64
        }
        Func::Spikes | Func::Events | Func::ContractViolations => f64::NAN,
    }
}

fn combine(over: Over, v: &[f64]) -> f64 {
    use super::stats;
    match over {
        Over::Mean => stats::mean(v),
        Over::Median => stats::median(v),
        Over::Min => v.iter().copied().fold(f64::INFINITY, f64::min),
        Over::Max => v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        Over::Sum => v.iter().sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Names {
        Names {
            configs: vec!["bf16".into(), "nvfp4-dq".into()],
            baseline: "bf16".into(),
            constants: vec![("margin".into(), 0.05)],
        }
    }

    struct Fake;
    impl Source for Fake {
        fn series(&self, config: &str, metric: &str) -> Vec<Vec<(usize, f64)>> {
            if metric != "rollout/raw_reward" {
                return vec![];
            }
            let base = if config == "bf16" { 0.7 } else { 0.6 };
            // two seeds, 20 steps, reward rising to `base` then flat
            (0..2)
                .map(|s| {
                    (0..20)
                        .map(|i| (i, if i < 10 { 0.0 } else { base + 0.01 * s as f64 }))
                        .collect()
                })
                .collect()
        }
        fn spikes(&self, config: &str, site: Option<&str>, _: Option<i64>) -> Vec<f64> {
            let n = if config == "bf16" { 0.0 } else { 2.0 };
            let m = if site.is_some_and(|s| s.contains("experts")) {
                n
            } else {
                n + 1.0
            };
            vec![m, m]
        }
        fn events(&self, _: &str, _: Option<&str>, _: Option<&str>) -> Vec<f64> {
            vec![0.0, 1.0]
        }
        fn contract_violations(&self, config: &str) -> Vec<f64> {
            if config == "bf16" {
                vec![0.0, 0.0]
            } else {
                vec![0.0, 3.0]
            }
        }
    }

    fn eval(text: &str, config: &str) -> Outcome {
        parse(text, &names())
            .unwrap()
            .eval(config, &Fake, &names().constants)
    }

    #[test]
    fn examples_from_the_issue_parse_and_evaluate() {
        let o = eval(
            "mean(rollout/raw_reward, last=10) >= bf16 - 0.05",
            "nvfp4-dq",
        );
        assert!(!o.passed, "0.605 vs 0.705 - 0.05 = 0.655 must fail: {o:?}");
        assert!(
            (o.lhs - 0.605).abs() < 1e-12 && (o.rhs - 0.655).abs() < 1e-12,
            "{o:?}"
        );
        assert!(o.message.contains("failed"), "{}", o.message);
        assert!(
            eval(
                "mean(rollout/raw_reward, last=10) >= baseline - 0.15",
                "nvfp4-dq"
            )
            .passed
        );
        assert!(eval("mean(rollout/raw_reward, last=10) >= bf16 - margin", "bf16").passed);
        // first 10 steps are 0, so the window matters
        assert_eq!(
            eval("mean(rollout/raw_reward, first=10) == 0", "bf16").lhs,
            0.0
        );
        assert_eq!(eval("max(rollout/raw_reward) < 3e-3", "bf16").lhs, 0.71);
        assert_eq!(eval("spikes(site=\"*experts*\") <= 2", "nvfp4-dq").lhs, 4.0);
        assert_eq!(
            eval("spikes(site=\"*experts*\", over=\"max\") <= 2", "nvfp4-dq").lhs,
            2.0
        );
        assert!(!eval("contract_violations == 0", "nvfp4-dq").passed);
        assert!(eval("contract_violations == 0", "bf16").passed);
        assert_eq!(
            eval("ratio_above(rollout/raw_reward, 0.5) > 0.4", "bf16").lhs,
            0.5
        );
        assert_eq!(eval("-(1 + 2) * 3 / 2 == -4.5", "bf16").lhs, -4.5);
    }

    #[test]
    fn a_missing_metric_fails_instead_of_passing() {
        let o = eval("mean(train/nothing) < 1", "bf16");
        assert!(
            !o.passed && o.message.contains("could not be evaluated"),
            "{o:?}"
        );
    }

    #[test]
    fn errors_point_at_the_bad_token() {
        let err = |t: &str| parse(t, &names()).unwrap_err();
        assert_eq!(err("mean(rollout/raw_reward) >").pos, 26);
        assert_eq!(err("maen(rollout/raw_reward) > 0").pos, 0);
        assert!(
            err("maen(rollout/raw_reward) > 0")
                .msg
                .contains("did you mean `mean`")
        );
        let e = err("mean(rollout/raw_reward, lst=3) > 0");
        assert_eq!(e.pos, 25);
        assert!(e.msg.contains("did you mean `last`"), "{}", e.msg);
        assert_eq!(err("mean(rollout/raw_reward) > bf17").pos, 27);
        assert_eq!(err("mean(rollout/raw_reward) > 1 2").pos, 29);
        assert_eq!(err("mean(rollout/raw_reward) # 1").pos, 25);
        assert_eq!(
            err("mean(x) + max(y) > bf16").pos,
            19,
            "two calls: bf16 is ambiguous"
        );
        assert_eq!(err("mean() > 0").pos, 0);
        assert_eq!(err("mean(a, config=\"fp9\") > 0").pos, 15);
        assert_eq!(err("rollout/raw_reward > 0").pos, 0);
        let r = err("mean(a, lst=3) > 0").render("mean(a, lst=3) > 0");
        assert!(r.ends_with("\n            ^"), "{r}");
    }

    #[test]
    fn deep_nesting_and_long_chains_are_errors_not_stack_overflows() {
        let deep = format!("{}1{} < 2", "(".repeat(200), ")".repeat(200));
        let e = parse(&deep, &names()).unwrap_err();
        assert!(e.msg.contains("nested more than 64"), "{e}");
        let signs = format!("{}1 < 2", "-".repeat(200));
        assert!(parse(&signs, &names()).unwrap_err().msg.contains("nested"));
        let deeper = format!("{}1{} < 2", "(".repeat(5000), ")".repeat(5000));
        assert!(parse(&deeper, &names()).is_err());
        let chain = format!("1{} < 2", " + 1".repeat(5000));
        let e = parse(&chain, &names()).unwrap_err();
        assert!(e.msg.contains("at most 512"), "{e}");
        let ok = format!("{}1{} < 2", "(".repeat(60), ")".repeat(60));
        assert!(parse(&ok, &names()).is_ok());
    }
}
