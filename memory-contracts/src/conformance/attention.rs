//! Section C: streamed attention.
//!
//! The key property: for every advertised K/V pair, random GQA shapes, decode widths 1..=4 and a
//! prefill width, attention over a plan that mixes resident pages and ring slots — laid out out
//! of order in the pool, cut into several spans with a partially filled last page, evaluated in
//! one wave and in several waves that reuse the ring — equals the evaluation of one
//! all-in-one-span plan over a contiguous buffer **bit for bit**, and equals
//! [`reference_attention_f64`] over the dequantised K/V within 1e-4 (relative to each head's
//! output magnitude). Walking out of order or finishing early are typed errors.

use super::{random_f32, rng};
use crate::attention::{
    attention_accumulate, attention_begin, attention_finish, reference_attention_f64,
    AttentionShape, StreamedAttention,
};
use crate::error::AttentionError;
use crate::kv::format::{decode, encode, KvType};
use crate::kv::geometry::PageGeometry;
use crate::kv::span::{Span, SpanPlan, SpanSource};
use crate::ops::TensorOps;
use crate::transfer::DeviceMemory;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

/// Query widths the suite exercises: decode/verify widths and one prefill chunk.
pub const WIDTHS: [usize; 5] = [1, 2, 3, 4, 37];

/// One random attention problem: queries, K/V encoded into a contiguous run of pages, and the
/// dequantised K/V the reference uses.
#[derive(Debug, Clone)]
pub struct AttentionCase {
    /// The evaluation's shape.
    pub shape: AttentionShape,
    /// The page geometry of `image`.
    pub geometry: PageGeometry,
    /// `[width, q_heads, head_dim]`.
    pub q: Vec<f32>,
    /// Dequantised `[total, kv_heads, head_dim]`.
    pub k: Vec<f32>,
    /// Dequantised `[total, kv_heads, head_dim]`.
    pub v: Vec<f32>,
    /// All `pages_for(total)` pages in logical order (the contiguous buffer).
    pub image: Vec<u8>,
}

/// A logical span of the case: pages `[first_page, first_page + pages)`, resident or ring.
#[derive(Debug, Clone, Copy)]
pub struct PlannedSpan {
    /// First logical page.
    pub first_page: usize,
    /// Pages in the span.
    pub pages: usize,
    /// First token (`first_page · tokens_per_page`).
    pub first_token: usize,
    /// Tokens (the last span may end inside its last page).
    pub count: usize,
    /// Streamed through the ring (else resident).
    pub ring: bool,
}

impl AttentionCase {
    /// A random case. `kv_heads` ∈ {1, 2}, group ∈ {1, 2, 3}, head_dim ∈ {32, 64}, 4–16 tokens
    /// per page, 2–9 pages of history before the queries, a partially filled last page.
    pub fn random(rng: &mut StdRng, k_type: KvType, v_type: KvType, width: usize) -> Self {
        let kv_heads = rng.random_range(1..=2usize);
        let q_heads = kv_heads * rng.random_range(1..=3usize);
        let head_dim = [32usize, 64][rng.random_range(0..2usize)];
        let tpp = [4usize, 8, 16][rng.random_range(0..3usize)];
        let mut total = rng.random_range(2 * tpp..9 * tpp) + width;
        if total % tpp == 0 {
            total += 1 + rng.random_range(0..tpp - 1);
        }
        let geometry =
            PageGeometry::new(tpp, kv_heads, head_dim, k_type, v_type).expect("valid geometry");
        let shape = AttentionShape {
            q_heads,
            kv_heads,
            head_dim,
            width,
            total,
            scale: (head_dim as f32).sqrt().recip(),
            k_type,
            v_type,
        };
        let rv = geometry.row_values();
        let q = random_f32(rng, shape.query_len(), 4.0);
        let k_raw = random_f32(rng, total * rv, 3.0);
        let v_raw = random_f32(rng, total * rv, 2.0);
        let mut image = vec![0u8; geometry.pages_for(total) * geometry.page_bytes()];
        let (kr, vr) = (geometry.k_row_bytes(), geometry.v_row_bytes());
        let mut k = vec![0f32; total * rv];
        let mut v = vec![0f32; total * rv];
        for t in 0..total {
            let ko = geometry.k_row_offset(0, 0, t);
            let vo = geometry.v_row_offset(0, 0, t);
            let row = t * rv..(t + 1) * rv;
            encode(k_type, &k_raw[row.clone()], &mut image[ko..ko + kr]).expect("encode K");
            encode(v_type, &v_raw[row.clone()], &mut image[vo..vo + vr]).expect("encode V");
            decode(k_type, &image[ko..ko + kr], &mut k[row.clone()]).expect("decode K");
            decode(v_type, &image[vo..vo + vr], &mut v[row]).expect("decode V");
        }
        Self {
            shape,
            geometry,
            q,
            k,
            v,
            image,
        }
    }

    /// Pages of the case.
    pub fn pages(&self) -> usize {
        self.geometry.pages_for(self.shape.total)
    }

    /// The bytes of pages `[first, first + n)` of the contiguous image.
    pub fn page_bytes(&self, first: usize, n: usize) -> &[u8] {
        let pb = self.geometry.page_bytes();
        &self.image[first * pb..(first + n) * pb]
    }

    /// Random page-aligned cuts into spans (at least two when there are two pages), each resident
    /// or ring, with both kinds present when there are several spans.
    pub fn random_spans(&self, rng: &mut StdRng) -> Vec<PlannedSpan> {
        let pages = self.pages();
        let tpp = self.geometry.tokens_per_page();
        let forced = if pages > 1 {
            rng.random_range(1..pages)
        } else {
            0
        };
        let mut spans = Vec::new();
        let mut first = 0;
        for p in 1..=pages {
            if p == pages || p == forced || rng.random_bool(0.4) {
                let first_token = first * tpp;
                spans.push(PlannedSpan {
                    first_page: first,
                    pages: p - first,
                    first_token,
                    count: (p * tpp).min(self.shape.total) - first_token,
                    ring: rng.random_bool(0.5),
                });
                first = p;
            }
        }
        if spans.len() > 1 && spans.iter().all(|s| s.ring == spans[0].ring) {
            let i = rng.random_range(0..spans.len());
            spans[i].ring = !spans[i].ring;
        }
        spans
    }
}

/// Runs `attention_begin` → one `attention_accumulate` per plan → `attention_finish` and
/// downloads the output.
pub fn evaluate<B: StreamedAttention + TensorOps>(
    b: &B,
    shape: AttentionShape,
    q: &B::Tensor,
    waves: &[(&B::Buffer, SpanPlan)],
) -> Result<Vec<f32>, AttentionError> {
    let mut acc = attention_begin(b, shape)?;
    for (pool, plan) in waves {
        attention_accumulate(b, &mut acc, q, pool, plan)?;
    }
    let out = attention_finish(b, acc)?;
    Ok(b.tensor_to_f32(&out).expect("tensor_to_f32"))
}

fn upload<B: DeviceMemory>(b: &B, bytes: &[u8]) -> B::Buffer {
    let buf = b.alloc_buffer(bytes.len()).expect("alloc_buffer");
    b.write_buffer(&buf, 0, bytes).expect("write_buffer");
    buf
}

/// The all-in-one-span evaluation over the contiguous image.
pub fn contiguous<B: StreamedAttention + DeviceMemory + TensorOps>(
    b: &B,
    case: &AttentionCase,
    q: &B::Tensor,
) -> Vec<f32> {
    let pool = upload(b, &case.image);
    let plan = SpanPlan::new(
        case.geometry,
        case.image.len(),
        0,
        case.shape.total,
        vec![Span {
            source: SpanSource::Resident {
                layer: 0,
                first_page: 0,
            },
            first_token: 0,
            count: case.shape.total,
            offset: 0,
        }],
    )
    .expect("contiguous plan");
    evaluate(b, case.shape, q, &[(&pool, plan)]).expect("contiguous attention")
}

/// The mixed evaluation: resident spans placed in shuffled order (with gaps) in a resident region,
/// ring spans streamed into a ring region wave by wave (each wave rewrites the ring in shuffled
/// order). With `multi_wave`, the ring holds only the largest ring span (plus slack) and the
/// walk takes at least two waves when there are two spans.
pub fn mixed<B: StreamedAttention + DeviceMemory + TensorOps>(
    b: &B,
    rng: &mut StdRng,
    case: &AttentionCase,
    spans: &[PlannedSpan],
    q: &B::Tensor,
    multi_wave: bool,
) -> Vec<f32> {
    let pb = case.geometry.page_bytes();
    // Resident region: shuffled placement with random one-page gaps.
    let mut resident: Vec<usize> = (0..spans.len()).filter(|&i| !spans[i].ring).collect();
    resident.shuffle(rng);
    let mut offsets = vec![0usize; spans.len()];
    let mut cursor = 0usize;
    for &i in &resident {
        cursor += rng.random_range(0..=1usize);
        offsets[i] = cursor;
        cursor += spans[i].pages;
    }
    let resident_pages = cursor;
    // Waves.
    let ring_total: usize = spans.iter().filter(|s| s.ring).map(|s| s.pages).sum();
    let ring_max = spans
        .iter()
        .filter(|s| s.ring)
        .map(|s| s.pages)
        .max()
        .unwrap_or(0);
    let ring_slots = if multi_wave {
        ring_max + rng.random_range(0..=1usize)
    } else {
        ring_total + rng.random_range(0..=2usize)
    };
    let mut waves: Vec<Vec<usize>> = vec![Vec::new()];
    let mut used = 0usize;
    for (i, s) in spans.iter().enumerate() {
        let need = if s.ring { s.pages } else { 0 };
        let current = waves.last().map(|w| !w.is_empty()).unwrap_or(false);
        let cut =
            current && multi_wave && (used + need > ring_slots || i == 1 || rng.random_bool(0.3));
        if cut {
            waves.push(Vec::new());
            used = 0;
        }
        used += need;
        if let Some(w) = waves.last_mut() {
            w.push(i);
        }
    }
    let pool_len = (resident_pages + ring_slots) * pb;
    let pool = b.alloc_buffer(pool_len.max(pb)).expect("alloc_buffer");
    for &i in &resident {
        let s = spans[i];
        b.write_buffer(
            &pool,
            offsets[i] * pb,
            case.page_bytes(s.first_page, s.pages),
        )
        .expect("write resident pages");
    }
    let mut acc = attention_begin(b, case.shape).expect("attention_begin");
    for wave in &waves {
        // Ring placement of this wave: shuffled, contiguous per span, slack at random places.
        let mut ring: Vec<usize> = wave.iter().copied().filter(|&i| spans[i].ring).collect();
        ring.shuffle(rng);
        let wave_ring: usize = ring.iter().map(|&i| spans[i].pages).sum();
        let mut slack = ring_slots - wave_ring;
        let mut slot = 0usize;
        for &i in &ring {
            let skip = rng.random_range(0..=slack);
            slack -= skip;
            slot += skip;
            offsets[i] = resident_pages + slot;
            let s = spans[i];
            b.write_buffer(
                &pool,
                offsets[i] * pb,
                case.page_bytes(s.first_page, s.pages),
            )
            .expect("write ring slots");
            slot += s.pages;
        }
        let plan_spans: Vec<Span> = wave
            .iter()
            .map(|&i| {
                let s = spans[i];
                Span {
                    source: if s.ring {
                        SpanSource::Ring {
                            first_slot: offsets[i] - resident_pages,
                        }
                    } else {
                        SpanSource::Resident {
                            layer: 0,
                            first_page: offsets[i],
                        }
                    },
                    first_token: s.first_token,
                    count: s.count,
                    offset: offsets[i] * pb,
                }
            })
            .collect();
        let start = plan_spans[0].first_token;
        let end = plan_spans[plan_spans.len() - 1].end_token();
        let plan =
            SpanPlan::new(case.geometry, pool_len.max(pb), start, end, plan_spans).expect("plan");
        attention_accumulate(b, &mut acc, q, &pool, &plan).expect("attention_accumulate");
    }
    let out = attention_finish(b, acc).expect("attention_finish");
    b.tensor_to_f32(&out).expect("tensor_to_f32")
}

/// Asserts `got` is within 1e-4 of `reference`, relative to each head's largest output.
pub fn assert_close_to_reference(got: &[f32], reference: &[f32], head_dim: usize, what: &str) {
    assert_eq!(got.len(), reference.len(), "{what}: output length");
    for (h, (g, r)) in got
        .chunks(head_dim)
        .zip(reference.chunks(head_dim))
        .enumerate()
    {
        let scale = r.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        for (j, (a, e)) in g.iter().zip(r).enumerate() {
            let tol = 1e-4 * e.abs().max(scale);
            assert!(
                (a - e).abs() <= tol,
                "{what}: (query·head {h}, dim {j}) got {a}, f64 reference {e}, tolerance {tol}"
            );
        }
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The key property (see the module docs), for every advertised pair and supported width.
pub fn streamed_equals_contiguous_and_f64_reference<
    B: StreamedAttention + DeviceMemory + TensorOps,
>(
    b: &B,
) {
    let caps = b.capabilities();
    for (pi, &(k_type, v_type)) in caps.kv_pairs.iter().enumerate() {
        for &width in &WIDTHS {
            if width > caps.max_decode_width && !caps.prefill_attention {
                continue;
            }
            let mut r = rng(1000 + pi as u64 * 16 + width as u64);
            let case = AttentionCase::random(&mut r, k_type, v_type, width);
            let sh = case.shape;
            let what = format!(
                "{k_type}/{v_type} width {width} total {} heads {}/{} dim {} page {}",
                sh.total,
                sh.q_heads,
                sh.kv_heads,
                sh.head_dim,
                case.geometry.tokens_per_page()
            );
            let q = b
                .tensor_from_f32(&case.q, &[width, sh.q_heads, sh.head_dim])
                .expect("tensor_from_f32");
            let whole = contiguous(b, &case, &q);
            let spans = case.random_spans(&mut r);
            for multi in [false, true] {
                let got = mixed(b, &mut r, &case, &spans, &q, multi);
                assert!(
                    bits(&got) == bits(&whole),
                    "{what}: mixed plan ({} spans, multi-wave {multi}) is not bit-identical to the contiguous plan",
                    spans.len()
                );
            }
            let reference = reference_attention_f64(&sh, &case.q, &case.k, &case.v);
            assert_close_to_reference(&whole, &reference, sh.head_dim, &what);
        }
    }
}

/// Out-of-order waves, early finishes, plans past the active tokens, mismatched geometry and
/// wrongly sized queries are typed errors.
pub fn walk_order_and_completeness_are_enforced<B: StreamedAttention + DeviceMemory + TensorOps>(
    b: &B,
) {
    let caps = b.capabilities();
    let Some(&(k_type, v_type)) = caps.kv_pairs.first() else {
        return;
    };
    let mut r = rng(7);
    let case = AttentionCase::random(&mut r, k_type, v_type, 1);
    let (g, sh) = (case.geometry, case.shape);
    let tpp = g.tokens_per_page();
    let pb = g.page_bytes();
    let pool = upload(b, &case.image);
    let span = |first_page: usize, end: usize| Span {
        source: SpanSource::Resident {
            layer: 0,
            first_page,
        },
        first_token: first_page * tpp,
        count: end - first_page * tpp,
        offset: first_page * pb,
    };
    let plan = |first_page: usize, end: usize| {
        SpanPlan::new(
            g,
            case.image.len(),
            first_page * tpp,
            end,
            vec![span(first_page, end)],
        )
        .expect("plan")
    };
    let q = b
        .tensor_from_f32(&case.q, &[1, sh.q_heads, sh.head_dim])
        .expect("tensor_from_f32");

    // Skipping the first page.
    let mut acc = attention_begin(b, sh).expect("begin");
    let e = attention_accumulate(b, &mut acc, &q, &pool, &plan(1, sh.total));
    assert!(
        matches!(e, Err(AttentionError::OutOfOrder { plan_start, next: 0 }) if plan_start == tpp),
        "skipped page: {e:?}"
    );
    // First wave, then the same wave again.
    attention_accumulate(b, &mut acc, &q, &pool, &plan(0, tpp)).expect("first wave");
    assert_eq!(acc.next_token(), tpp);
    let e = attention_accumulate(b, &mut acc, &q, &pool, &plan(0, tpp));
    assert!(
        matches!(e, Err(AttentionError::OutOfOrder { plan_start: 0, next }) if next == tpp),
        "repeated wave: {e:?}"
    );
    // Finishing before every token was walked.
    let e = attention_finish(b, acc);
    assert!(
        matches!(e, Err(AttentionError::Incomplete { covered, total }) if covered == tpp && total == sh.total),
        "early finish: {e:?}"
    );
    // A plan reaching past the active tokens.
    let longer = AttentionShape {
        total: sh.total - 1,
        width: 1,
        ..sh
    };
    let mut acc = attention_begin(b, longer).expect("begin");
    let e = attention_accumulate(b, &mut acc, &q, &pool, &plan(0, sh.total));
    assert!(
        matches!(e, Err(AttentionError::Incomplete { .. })),
        "plan past the active tokens: {e:?}"
    );
    // Geometry of another K type.
    let other = KvType::ALL
        .into_iter()
        .find(|&t| t != k_type && sh.head_dim % t.block_values() == 0)
        .unwrap_or(KvType::F32);
    let g2 = PageGeometry::new(tpp, sh.kv_heads, sh.head_dim, other, v_type).expect("geometry");
    let big = b
        .alloc_buffer(g2.pages_for(sh.total) * g2.page_bytes())
        .expect("alloc");
    let p2 = SpanPlan::new(
        g2,
        g2.pages_for(sh.total) * g2.page_bytes(),
        0,
        sh.total,
        vec![Span {
            offset: 0,
            ..span(0, sh.total)
        }],
    )
    .expect("plan");
    let mut acc = attention_begin(b, sh).expect("begin");
    let e = attention_accumulate(b, &mut acc, &q, &big, &p2);
    assert!(
        matches!(e, Err(AttentionError::GeometryMismatch)),
        "geometry mismatch: {e:?}"
    );
    // Queries of the wrong size.
    let q_bad = b
        .tensor_from_f32(&case.q[..sh.head_dim], &[1, 1, sh.head_dim])
        .expect("tensor_from_f32");
    let e = attention_accumulate(b, &mut acc, &q_bad, &pool, &plan(0, sh.total));
    assert!(
        matches!(e, Err(AttentionError::Shape { name: "q", .. })),
        "wrong query size: {e:?}"
    );
    // The accumulator is still usable after rejected requests.
    attention_accumulate(b, &mut acc, &q, &pool, &plan(0, sh.total)).expect("full walk");
    let out = attention_finish(b, acc).expect("finish");
    let out = b.tensor_to_f32(&out).expect("download");
    let reference = reference_attention_f64(&sh, &case.q, &case.k, &case.v);
    assert_close_to_reference(&out, &reference, sh.head_dim, "after rejected requests");
}
