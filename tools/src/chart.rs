//! `kvplan chart CSV PNG`: the README's bar chart, drawn from the bench table it summarises.
//!
//! The CSV has a header and rows `op,sglang_us,kvplan_us` (GPU us per call on one H200).

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontStyle, register_font};

/// DejaVu Sans (Bitstream Vera licence, `tools/assets/LICENSE-DejaVu`): text needs a font, and the
/// chart must draw the same on every machine.
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// One row of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// What was timed, e.g. `masked gather (4096, 128)`.
    pub op: String,
    /// sglang's GPU us.
    pub sglang_us: f64,
    /// kvplan's GPU us.
    pub kvplan_us: f64,
}

/// Parses the CSV: a header line, then `op,sglang_us,kvplan_us` (the op may not hold a comma).
pub fn parse(text: &str) -> Result<Vec<Row>, String> {
    text.lines()
        .enumerate()
        .skip(1)
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(number, line)| {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let [op, sglang, kvplan] = fields[..] else {
                return Err(format!(
                    "line {}: expected op,sglang_us,kvplan_us, got {line:?}",
                    number + 1
                ));
            };
            let value = |field: &str, name: &str| {
                field
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .ok_or_else(|| {
                        format!(
                            "line {}: {name} {field:?} is not a positive number",
                            number + 1
                        )
                    })
            };
            Ok(Row {
                op: op.to_string(),
                sglang_us: value(sglang, "sglang_us")?,
                kvplan_us: value(kvplan, "kvplan_us")?,
            })
        })
        .collect()
}

/// Draws grouped horizontal bars (log scale) of both columns into a PNG.
pub fn draw(rows: &[Row], png: &Path) -> Result<(), String> {
    if rows.is_empty() {
        return Err("the table has no rows".into());
    }
    register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| "the bundled font cannot be read".to_string())?;
    let height = 80 + 36 * rows.len() as u32;
    let root = BitMapBackend::new(png, (960, height)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| format!("{e}");
    root.fill(&WHITE).map_err(err)?;
    let max = rows
        .iter()
        .map(|r| r.sglang_us.max(r.kvplan_us))
        .fold(1.0, f64::max)
        * 2.0;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "GPU us per call on one H200 (lower is better)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(230)
        .build_cartesian_2d((1.0..max).log_scale(), 0.0..rows.len() as f64 * 3.0)
        .map_err(|e| format!("{e}"))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .x_desc("us")
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|e| format!("{e}"))?;
    // Row k takes three units from the top: its two bars and a gap.
    let top = rows.len() as f64 * 3.0;
    let bars = |pick: fn(&Row) -> f64, lane: f64, color: RGBColor| {
        rows.iter().enumerate().map(move |(k, row)| {
            let y = top - 3.0 * k as f64 - lane;
            Rectangle::new([(1.0, y - 1.0), (pick(row), y)], color.filled())
        })
    };
    let label = ("sans-serif", 13)
        .into_font()
        .into_text_style(&root)
        .pos(Pos::new(HPos::Right, VPos::Center));
    for (k, row) in rows.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(1.0, top - 3.0 * k as f64 - 1.0));
        root.draw(&Text::new(row.op.clone(), (x - 8, y), label.clone()))
            .map_err(err)?;
    }
    chart
        .draw_series(bars(|r| r.sglang_us, 0.0, RGBColor(170, 170, 170)))
        .map_err(|e| format!("{e}"))?
        .label("sglang")
        .legend(|(x, y)| {
            Rectangle::new(
                [(x, y - 5), (x + 14, y + 5)],
                RGBColor(170, 170, 170).filled(),
            )
        });
    chart
        .draw_series(bars(|r| r.kvplan_us, 1.0, RGBColor(31, 119, 180)))
        .map_err(|e| format!("{e}"))?
        .label("kvplan")
        .legend(|(x, y)| {
            Rectangle::new(
                [(x, y - 5), (x + 14, y + 5)],
                RGBColor(31, 119, 180).filled(),
            )
        });
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| format!("{e}"))?;
    root.present().map_err(|e| format!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rows_and_names_bad_fields() {
        let rows = parse("op,sglang_us,kvplan_us\nplan 1 x 512,5.4,3.03\n\n").unwrap();
        assert_eq!(
            rows,
            vec![Row {
                op: "plan 1 x 512".into(),
                sglang_us: 5.4,
                kvplan_us: 3.03
            }]
        );
        assert_eq!(
            parse("h\nplan,5.4").unwrap_err(),
            "line 2: expected op,sglang_us,kvplan_us, got \"plan,5.4\""
        );
        assert_eq!(
            parse("h\nplan,5.4,-1").unwrap_err(),
            "line 2: kvplan_us \"-1\" is not a positive number"
        );
        assert_eq!(
            draw(&[], Path::new("/nonexistent.png")).unwrap_err(),
            "the table has no rows"
        );
    }

    #[test]
    fn draws_a_png() {
        let rows = parse(include_str!("../../benches/h200.csv")).unwrap();
        let path = std::env::temp_dir().join(format!("kvplan-chart-{}.png", std::process::id()));
        draw(&rows, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(bytes.len() > 10_000, "{} bytes", bytes.len());
    }
}
