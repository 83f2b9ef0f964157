//! Writing the rows: CSV, JSONL and an SVG plot of decode tokens/s against context.

use super::row::BenchRow;
use anyhow::{Context, Result};
use plotters::prelude::*;
use std::io::Write;
use std::path::Path;

/// CSV header (one column per scalar; lists are `;`-separated inside a cell).
pub const CSV_HEADER: &str = "backend,model,kv_types,weights,arena_bytes,max_pool_pages,context,history_tokens,fill,spec_draft_n_max,status,note,prefill_tok_per_s,decode_tok_per_s,step_ms,step_ms_w1,step_ms_w2,step_ms_w3,step_ms_w4,h2d_bytes_per_step,h2d_gbps,resident_pages,ring_slots,pool_pages,weight_bytes,peak_arena_bytes,peak_device_bytes,acceptance,accepted_per_step,projections,h2d_ceiling_gbps,hbm_ceiling_gbps,roofline_step_ms,measured_over_roofline,peak_device_measured_bytes,step_issue_ms";

fn opt(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.6}")).unwrap_or_default()
}

fn cell(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// One CSV line for `r` (no newline).
pub fn csv_line(r: &BenchRow) -> String {
    let w = |i: usize| opt(r.step_ms_by_width.get(i).copied().flatten());
    let pages = r
        .resident_pages
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(";");
    let proj = r
        .projections
        .iter()
        .map(|p| format!("a={:.2}:{:.3}tok/s", p.acceptance, p.tok_per_s))
        .collect::<Vec<_>>()
        .join(";");
    [
        cell(&r.backend),
        cell(&r.model),
        cell(&r.kv_types),
        cell(&r.weights),
        r.arena_bytes.to_string(),
        r.max_pool_pages.map(|p| p.to_string()).unwrap_or_default(),
        r.context.to_string(),
        r.history_tokens.to_string(),
        cell(&r.fill),
        r.spec_draft_n_max.to_string(),
        cell(&r.status),
        cell(&r.note),
        opt(r.prefill_tok_per_s),
        opt(r.decode_tok_per_s),
        opt(r.step_ms),
        w(0),
        w(1),
        w(2),
        w(3),
        format!("{:.1}", r.h2d_bytes_per_step),
        format!("{:.6}", r.h2d_gbps),
        pages,
        r.ring_slots.to_string(),
        r.pool_pages.to_string(),
        r.weight_bytes.to_string(),
        r.peak_arena_bytes.to_string(),
        r.peak_device_bytes.to_string(),
        opt(r.acceptance),
        opt(r.accepted_per_step),
        cell(&proj),
        opt(r.ceilings.map(|c| c.h2d_gbps)),
        opt(r.ceilings.map(|c| c.hbm_gbps)),
        opt(r.roofline_step_ms),
        opt(r.measured_over_roofline),
        r.peak_device_measured_bytes
            .map(|b| b.to_string())
            .unwrap_or_default(),
        opt(r.step_issue_ms),
    ]
    .join(",")
}

/// Writes `bench.csv`, `bench.jsonl` and `bench.svg` into `dir` (created if needed).
pub fn write_all(dir: &Path, rows: &[BenchRow]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write_csv(&dir.join("bench.csv"), rows)?;
    write_jsonl(&dir.join("bench.jsonl"), rows)?;
    write_svg(&dir.join("bench.svg"), rows)
}

/// CSV with [`CSV_HEADER`].
pub fn write_csv(path: &Path, rows: &[BenchRow]) -> Result<()> {
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    writeln!(f, "{CSV_HEADER}")?;
    for r in rows {
        writeln!(f, "{}", csv_line(r))?;
    }
    f.flush()?;
    Ok(())
}

/// One JSON object per row.
pub fn write_jsonl(path: &Path, rows: &[BenchRow]) -> Result<()> {
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    for r in rows {
        writeln!(f, "{}", serde_json::to_string(r)?)?;
    }
    f.flush()?;
    Ok(())
}

/// Decode tokens/s (measured, solid) and the roofline's tokens/s (dashed-style thin line) against
/// history tokens, one series per arena size, for the n = 0 rows.
pub fn write_svg(path: &Path, rows: &[BenchRow]) -> Result<()> {
    let mut arenas: Vec<u64> = rows.iter().map(|r| r.arena_bytes).collect();
    arenas.sort_unstable();
    arenas.dedup();
    let pts = |arena: u64, roof: bool| -> Vec<(f64, f64)> {
        rows.iter()
            .filter(|r| r.arena_bytes == arena && r.spec_draft_n_max == 0)
            .filter_map(|r| {
                let y = if roof {
                    r.roofline_step_ms.filter(|m| *m > 0.0).map(|m| 1e3 / m)
                } else {
                    r.decode_tok_per_s
                };
                y.map(|y| (r.history_tokens as f64, y))
            })
            .collect()
    };
    let all: Vec<(f64, f64)> = arenas
        .iter()
        .flat_map(|&a| pts(a, false).into_iter().chain(pts(a, true)))
        .collect();
    let xmax = all.iter().map(|p| p.0).fold(1.0, f64::max) * 1.05;
    let ymax = all.iter().map(|p| p.1).fold(1e-9, f64::max) * 1.1;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("plot {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "kvstream decode tok/s vs context (solid: measured, thin: roofline)",
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("history tokens")
        .y_desc("decode tokens/s")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, &a) in arenas.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let label = format!("arena {} MiB", a >> 20);
        chart
            .draw_series(LineSeries::new(pts(a, false), color.stroke_width(3)))
            .map_err(|e| err(&e))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart
            .draw_series(LineSeries::new(pts(a, true), color.stroke_width(1)))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ctx: usize, tps: f64) -> BenchRow {
        BenchRow {
            backend: "cpu".into(),
            model: "synthetic:tiny".into(),
            kv_types: "f16/f16".into(),
            weights: "q4_g128 (head q8_0)".into(),
            note: "a, \"quoted\" note".into(),
            arena_bytes: 64 << 20,
            context: ctx,
            history_tokens: ctx,
            decode_tok_per_s: Some(tps),
            step_ms: Some(1e3 / tps),
            step_ms_by_width: vec![Some(1.0), Some(2.0), None, Some(4.0)],
            resident_pages: vec![3, 1],
            roofline_step_ms: Some(0.5),
            peak_device_measured_bytes: (ctx > 2048).then_some(3 << 30),
            step_issue_ms: (ctx > 2048).then_some(2.5),
            ..Default::default()
        }
    }

    #[test]
    fn csv_jsonl_and_svg_round_trip_the_rows() {
        let dir = std::env::temp_dir().join(format!("kvstream-bench-out-{}", std::process::id()));
        let rows = vec![row(1024, 123.5), row(4096, 77.25)];
        write_all(&dir, &rows).expect("write");
        let csv = std::fs::read_to_string(dir.join("bench.csv")).expect("csv");
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 3);
        let cols = CSV_HEADER.split(',').count();
        assert_eq!(cols, 36);
        // The driver-measured peak and the host issue time: empty on a backend or row without
        // them, bytes and milliseconds otherwise.
        assert!(lines[1].ends_with(",,"), "{}", lines[1]);
        assert!(lines[2].ends_with(",3221225472,2.500000"), "{}", lines[2]);
        assert!(
            lines[1].contains(",f16/f16,q4_g128 (head q8_0),"),
            "{}",
            lines[1]
        );
        assert!(
            lines[1].contains("\"a, \"\"quoted\"\" note\""),
            "{}",
            lines[1]
        );
        assert!(lines[2].contains("77.250000"), "{}", lines[2]);
        assert!(lines[1].contains(",3;1,"), "{}", lines[1]);
        let jsonl = std::fs::read_to_string(dir.join("bench.jsonl")).expect("jsonl");
        let back: Vec<BenchRow> = jsonl
            .lines()
            .map(|l| serde_json::from_str(l).expect("row"))
            .collect();
        assert_eq!(back, rows);
        let svg = std::fs::read_to_string(dir.join("bench.svg")).expect("svg");
        assert!(
            svg.starts_with("<svg") && svg.contains("polyline"),
            "{}",
            &svg[..200.min(svg.len())]
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
