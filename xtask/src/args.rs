//! A small `--name value` option parser with clear errors.

use std::collections::HashMap;
use std::str::FromStr;

/// Parsed `--name value` pairs; every option must be one of `known`.
pub struct Options {
    values: HashMap<String, String>,
}

impl Options {
    /// Parses `args`; `--help` anywhere returns `Ok(None)`.
    pub fn parse(args: Vec<String>, known: &[&str]) -> Result<Option<Self>, String> {
        let mut values = HashMap::new();
        let mut it = args.into_iter();
        while let Some(arg) = it.next() {
            if arg == "--help" || arg == "-h" {
                return Ok(None);
            }
            let name = arg.strip_prefix("--").ok_or_else(|| format!("unexpected argument `{arg}`"))?;
            if !known.contains(&name) {
                let known = match known {
                    [] => "this command takes none".to_string(),
                    _ => format!("known: {}", known.iter().map(|k| format!("--{k}")).collect::<Vec<_>>().join(", ")),
                };
                return Err(format!("unknown option `--{name}` ({known})"));
            }
            let value = it.next().ok_or_else(|| format!("option `--{name}` needs a value"))?;
            if values.insert(name.to_string(), value).is_some() {
                return Err(format!("option `--{name}` given twice"));
            }
        }
        Ok(Some(Options { values }))
    }

    /// Whether `--name` was given.
    pub fn has(&self, name: &str) -> bool {
        self.values.contains_key(name)
    }

    /// A `--name yes|no` option.
    pub fn yes_no(&self, name: &str, default: bool) -> Result<bool, String> {
        match self.get(name, String::new())?.as_str() {
            "" => Ok(default),
            "yes" => Ok(true),
            "no" => Ok(false),
            other => Err(format!("option `--{name}`: `{other}`; yes or no expected")),
        }
    }

    /// The value of `--name` parsed as `T`, or `default`.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> Result<T, String> {
        match self.values.get(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| format!("option `--{name}`: cannot parse `{v}`")),
        }
    }
}
