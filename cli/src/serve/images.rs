//! Image sources of OpenAI `image_url` content parts: data URLs (base64 PNG/JPEG/WebP) and
//! local files (`file:///abs/path` or an absolute path). Nothing is ever fetched from the
//! network: `http(s)://` URLs are refused with a 400 naming the rule.

use super::api::ApiError;
use std::path::PathBuf;

/// Largest image payload accepted (decoded bytes of a data URL, or file size).
pub const MAX_IMAGE_BYTES: usize = 32 << 20;

/// Where an image's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRef {
    /// Bytes decoded from a data URL.
    Data(Vec<u8>),
    /// An absolute local path, read by the engine thread.
    File(PathBuf),
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::invalid(msg, Some("messages"))
}

/// Parses the `url` of an `image_url` part.
pub fn parse_image_url(url: &str) -> Result<ImageRef, ApiError> {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Err(bad(
            "remote image URLs are not fetched (kvstream serve never accesses the network): send \
             the image inline as a data URL (data:image/png;base64,...) or as a local file path \
             (file:///abs/path.png or /abs/path.png)",
        ));
    }
    if let Some(rest) = strip_prefix_ci(url, "data:") {
        return parse_data_url(rest).map(ImageRef::Data);
    }
    if let Some(rest) = strip_prefix_ci(url, "file://") {
        if !rest.starts_with('/') {
            return Err(bad(format!(
                "file URL `{url}` must be file:///absolute/path (no host)"
            )));
        }
        return Ok(ImageRef::File(PathBuf::from(rest)));
    }
    if url.starts_with('/') {
        return Ok(ImageRef::File(PathBuf::from(url)));
    }
    Err(bad(format!(
        "unsupported image URL `{}`: use a data URL (data:image/png;base64,...) or an absolute \
         local file path",
        url.chars().take(40).collect::<String>()
    )))
}

fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// `data:[<media type>][;base64],<payload>` (after `data:`): base64 image bytes.
fn parse_data_url(rest: &str) -> Result<Vec<u8>, ApiError> {
    let Some((meta, payload)) = rest.split_once(',') else {
        return Err(bad("malformed data URL: no `,` before the payload"));
    };
    let mut parts = meta.split(';');
    let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
    let base64 = parts.any(|p| p.trim().eq_ignore_ascii_case("base64"));
    if !base64 {
        return Err(bad(
            "data URL images must be base64 encoded (data:image/png;base64,...)",
        ));
    }
    if !media.is_empty()
        && !matches!(
            media.as_str(),
            "image/png" | "image/jpeg" | "image/jpg" | "image/webp"
        )
    {
        return Err(bad(format!(
            "unsupported image media type `{media}`: PNG, JPEG and WebP are supported"
        )));
    }
    if payload.len() / 4 * 3 > MAX_IMAGE_BYTES {
        return Err(bad(format!(
            "image data URL exceeds {MAX_IMAGE_BYTES} bytes"
        )));
    }
    decode_base64(payload).map_err(|e| bad(format!("malformed base64 image data: {e}")))
}

/// Standard base64 (RFC 4648 §4; `-`/`_` of the URL-safe alphabet are accepted too), optional
/// `=` padding, ASCII whitespace ignored.
pub fn decode_base64(s: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let (mut acc, mut bits, mut n, mut pad) = (0u32, 0u32, 0usize, 0usize);
    for (i, c) in s.bytes().enumerate() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' => {
                pad += 1;
                continue;
            }
            c if c.is_ascii_whitespace() => continue,
            _ => return Err(format!("invalid character at offset {i}")),
        };
        if pad > 0 {
            return Err(format!("data after `=` padding at offset {i}"));
        }
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        n += 1;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    if n % 4 == 1 || pad > 2 || (pad > 0 && (n + pad) % 4 != 0) {
        return Err("truncated or badly padded base64".into());
    }
    if n == 0 {
        return Err("empty payload".into());
    }
    Ok(out)
}

/// The bytes of an image (reads files; run on the engine thread).
pub fn load_image(r: &ImageRef) -> Result<Vec<u8>, ApiError> {
    match r {
        ImageRef::Data(b) => Ok(b.clone()),
        ImageRef::File(p) => {
            let meta = std::fs::metadata(p)
                .map_err(|e| bad(format!("cannot read image file `{}`: {e}", p.display())))?;
            if !meta.is_file() {
                return Err(bad(format!("`{}` is not a file", p.display())));
            }
            if meta.len() > MAX_IMAGE_BYTES as u64 {
                return Err(bad(format!(
                    "image file `{}` has {} bytes; at most {MAX_IMAGE_BYTES} are accepted",
                    p.display(),
                    meta.len()
                )));
            }
            std::fs::read(p)
                .map_err(|e| bad(format!("cannot read image file `{}`: {e}", p.display())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(b: &[u8]) -> String {
        const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut s = String::new();
        for c in b.chunks(3) {
            let n = c.len();
            let v = (u32::from(c[0]) << 16)
                | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
                | u32::from(*c.get(2).unwrap_or(&0));
            for k in 0..4 {
                if k <= n {
                    s.push(A[(v >> (18 - 6 * k) & 63) as usize] as char);
                } else {
                    s.push('=');
                }
            }
        }
        s
    }

    #[test]
    fn base64_round_trips_and_rejects_garbage() {
        let mut x = 0x1234_5678u32;
        for len in 0..40usize {
            let data: Vec<u8> = (0..len)
                .map(|_| {
                    x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (x >> 24) as u8
                })
                .collect();
            let enc = encode(&data);
            if len == 0 {
                assert!(decode_base64(&enc).is_err());
                continue;
            }
            assert_eq!(decode_base64(&enc).expect("decodes"), data, "len {len}");
            assert_eq!(
                decode_base64(enc.trim_end_matches('=')).expect("unpadded"),
                data
            );
        }
        assert!(decode_base64("ab$d").is_err());
        assert!(decode_base64("abcde").is_err());
        assert!(decode_base64("ab=c").is_err());
    }

    #[test]
    fn urls_are_classified_and_remote_ones_refused() {
        let e = parse_image_url("https://example.com/cat.png").expect_err("remote");
        assert!(e.message.contains("not fetched"), "{}", e.message);
        assert_eq!(e.status, 400);
        assert!(parse_image_url("HTTP://x").is_err());
        assert_eq!(
            parse_image_url("file:///tmp/a.png").expect("file"),
            ImageRef::File("/tmp/a.png".into())
        );
        assert_eq!(
            parse_image_url("/tmp/b.png").expect("path"),
            ImageRef::File("/tmp/b.png".into())
        );
        assert!(parse_image_url("file://host/a.png").is_err());
        assert!(parse_image_url("relative.png").is_err());
        assert_eq!(
            parse_image_url(&format!("data:image/png;base64,{}", encode(b"\x89PNGxyz")))
                .expect("data"),
            ImageRef::Data(b"\x89PNGxyz".to_vec())
        );
        assert!(parse_image_url("data:image/gif;base64,R0lG").is_err());
        assert!(parse_image_url("data:image/png,rawbytes").is_err());
        assert!(parse_image_url("data:image/png;base64,@@@@").is_err());
    }
}
