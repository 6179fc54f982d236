//! Typed reads of a JSON object whose errors name the file and the full field path.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Reads a JSON file into a value; a syntax error names the file, line and column.
pub fn read_json(file: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(file).map_err(|e| Error::io(file, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Json {
        file: file.to_path_buf(),
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })
}

/// A JSON object seen from a field path (`""` at the top, `"dflash_config."` inside it).
pub struct Fields<'a> {
    file: PathBuf,
    prefix: String,
    obj: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// The top-level object of `value`, read from `file`.
    pub fn top(file: &Path, value: &'a Value) -> Result<Self> {
        let obj = value.as_object().ok_or_else(|| Error::Field {
            file: file.to_path_buf(),
            field: "<top level>".into(),
            message: "expected a JSON object".into(),
        })?;
        Ok(Fields { file: file.to_path_buf(), prefix: String::new(), obj })
    }

    /// An error about field `key` of this object.
    pub fn error(&self, key: &str, message: impl Into<String>) -> Error {
        Error::Field { file: self.file.clone(), field: format!("{}{key}", self.prefix), message: message.into() }
    }

    /// The field's value; JSON `null` counts as absent.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn required<T>(&self, key: &str, value: Result<Option<T>>) -> Result<T> {
        value?.ok_or_else(|| self.error(key, "missing"))
    }

    /// Whether the field is present and not null.
    pub fn has(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// The keys of this object whose values are not null (sorted).
    pub fn keys(&self) -> Vec<&'a str> {
        self.obj.iter().filter(|(_, v)| !v.is_null()).map(|(k, _)| k.as_str()).collect()
    }

    /// The nested object `key`, if present.
    pub fn object(&self, key: &str) -> Result<Option<Fields<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(obj)) => {
                Ok(Some(Fields { file: self.file.clone(), prefix: format!("{}{key}.", self.prefix), obj }))
            }
            Some(_) => Err(self.error(key, "expected an object")),
        }
    }

    fn as_usize(&self, key: &str, v: &Value) -> Result<usize> {
        v.as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| self.error(key, format!("expected a non-negative integer, found {v}")))
    }

    /// An optional non-negative integer.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key).map(|v| self.as_usize(key, v)).transpose()
    }

    /// A required non-negative integer.
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.required(key, self.opt_usize(key))
    }

    /// A required integer that must be at least 1.
    pub fn positive(&self, key: &str) -> Result<usize> {
        let n = self.usize(key)?;
        if n == 0 {
            return Err(self.error(key, "must be at least 1"));
        }
        Ok(n)
    }

    /// An optional number.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.error(key, format!("expected a number, found {v}"))))
            .transpose()
    }

    /// A required number.
    pub fn f64(&self, key: &str) -> Result<f64> {
        self.required(key, self.opt_f64(key))
    }

    /// An optional boolean.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.error(key, format!("expected true or false, found {v}"))))
            .transpose()
    }

    /// An optional string.
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.error(key, format!("expected a string, found {v}"))))
            .transpose()
    }

    fn opt_list<T>(&self, key: &str, item: impl Fn(&Value) -> Option<T>, what: &str) -> Result<Option<Vec<T>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v.as_array().ok_or_else(|| self.error(key, format!("expected a list of {what}")))?;
        arr.iter()
            .enumerate()
            .map(|(i, x)| {
                item(x).ok_or_else(|| self.error(&format!("{key}[{i}]"), format!("expected {what}, found {x}")))
            })
            .collect::<Result<Vec<T>>>()
            .map(Some)
    }

    /// An optional list of strings.
    pub fn opt_str_list(&self, key: &str) -> Result<Option<Vec<String>>> {
        self.opt_list(key, |x| x.as_str().map(str::to_owned), "strings")
    }

    /// An optional list of non-negative integers.
    pub fn opt_usize_list(&self, key: &str) -> Result<Option<Vec<usize>>> {
        self.opt_list(key, |x| x.as_u64().map(|n| n as usize), "non-negative integers")
    }
}
