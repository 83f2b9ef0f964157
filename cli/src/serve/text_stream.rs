//! Incremental detokenisation with stop sequences.
//!
//! Byte-level BPE tokens can end in the middle of a UTF-8 character, and a stop string can span
//! several tokens. [`TextStream`] re-decodes the generated tokens, emits only text that is final
//! (no trailing replacement character, no suffix that could still grow into a stop string), and
//! reports when a stop string appears (the stop string itself is not emitted).

/// Result of pushing one token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    /// New text that is final.
    pub delta: String,
    /// A stop string was found; generation must end.
    pub stopped: bool,
}

/// Incremental text of a generation.
#[derive(Debug, Default)]
pub struct TextStream {
    stop: Vec<String>,
    emitted: usize,
    full: String,
    done: bool,
}

impl TextStream {
    pub fn new(stop: Vec<String>) -> Self {
        Self {
            stop,
            ..Self::default()
        }
    }

    /// Feeds the full decoded text of all tokens so far.
    pub fn update(&mut self, decoded: String) -> Pushed {
        if self.done {
            return Pushed {
                delta: String::new(),
                stopped: true,
            };
        }
        self.full = decoded;
        // A stop string anywhere in the not-yet-emitted region (it may start in emitted text
        // only if it was held back, which the hold-back rule prevents).
        let search_from = self
            .emitted
            .saturating_sub(self.max_stop().saturating_sub(1));
        let search_from = floor_char_boundary(&self.full, search_from);
        let found = self
            .stop
            .iter()
            .filter_map(|s| {
                self.full[search_from..]
                    .find(s.as_str())
                    .map(|i| i + search_from)
            })
            .min();
        if let Some(at) = found {
            self.done = true;
            let at = at.max(self.emitted);
            let delta = self.full[self.emitted..at].to_string();
            self.emitted = at;
            return Pushed {
                delta,
                stopped: true,
            };
        }
        // Hold back an incomplete UTF-8 tail and any suffix that is a prefix of a stop string.
        let mut end = self.full.len();
        if self.full.ends_with('\u{FFFD}') {
            end -= '\u{FFFD}'.len_utf8();
        }
        for s in &self.stop {
            for k in (1..s.len()).rev() {
                if !s.is_char_boundary(k) {
                    continue;
                }
                if self.full[..end].ends_with(&s[..k]) {
                    end = end.min(self.full.len() - k);
                    break;
                }
            }
        }
        let end = floor_char_boundary(&self.full, end.max(self.emitted));
        let delta = self.full[self.emitted..end].to_string();
        self.emitted = end;
        Pushed {
            delta,
            stopped: false,
        }
    }

    /// Text held back at the end of a generation (flush when it ends without a stop string).
    pub fn finish(&mut self) -> String {
        if self.done {
            return String::new();
        }
        self.done = true;
        let rest = self.full[self.emitted..]
            .trim_end_matches('\u{FFFD}')
            .to_string();
        self.emitted = self.full.len();
        rest
    }

    fn max_stop(&self) -> usize {
        self.stop.iter().map(String::len).max().unwrap_or(0)
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_string_split_over_tokens_is_not_emitted() {
        let mut t = TextStream::new(vec!["END".into()]);
        let mut out = String::new();
        let mut stopped = false;
        for s in ["Hel", "Hello E", "Hello EN", "Hello ENDing"] {
            let p = t.update(s.to_string());
            out.push_str(&p.delta);
            stopped = p.stopped;
        }
        assert!(stopped);
        assert_eq!(out, "Hello ");
    }

    #[test]
    fn incomplete_utf8_is_held_back_and_flushed() {
        let mut t = TextStream::new(vec![]);
        assert_eq!(t.update("a\u{FFFD}".into()).delta, "a");
        assert_eq!(t.update("aé".into()).delta, "é");
        assert_eq!(t.update("aéb".into()).delta, "b");
        assert_eq!(t.finish(), "");
        let mut t = TextStream::new(vec!["xyz".into()]);
        assert_eq!(t.update("ab x".into()).delta, "ab ");
        assert_eq!(t.finish(), "x");
    }
}
