//! `kvplan chart CSV PNG`: the README's bar charts, drawn from the tables they summarise.
//!
//! The CSV's header is the chart's caption, then one name a series; each row is a label, then one
//! positive value a series (e.g. `GPU us per call on one H200 (lower is better),sglang,kvplan`,
//! then `masked gather 1 x 8,15.8,2.56`). The labels may not hold a comma.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontStyle, register_font};

/// DejaVu Sans (Bitstream Vera licence, `tools/assets/LICENSE-DejaVu`): text needs a font, and the
/// chart must draw the same on every machine.
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// Bar colours, the last series' last (kvplan's blue; the one before it grey).
const COLORS: [RGBColor; 4] = [
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(170, 170, 170),
    RGBColor(31, 119, 180),
];

/// A chart's table.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// The caption (the header's first field).
    pub caption: String,
    /// The series' names, in column order.
    pub series: Vec<String>,
    /// The rows.
    pub rows: Vec<Row>,
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// What was measured, e.g. `masked gather (4096, 128)`.
    pub label: String,
    /// One value a series.
    pub values: Vec<f64>,
}

/// Parses the CSV: the header (caption, series), then a label and one value a series a row.
pub fn parse(text: &str) -> Result<Table, String> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let (_, header) = lines.next().ok_or("the table has no header")?;
    let mut fields = header.split(',').map(str::trim);
    let caption = fields.next().unwrap_or_default().to_string();
    let series: Vec<String> = fields.map(str::to_string).collect();
    if series.is_empty() || series.len() > COLORS.len() {
        return Err(format!(
            "line 1: expected a caption and 1 to {} series, got {header:?}",
            COLORS.len()
        ));
    }
    let rows = lines
        .map(|(number, line)| {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            if fields.len() != series.len() + 1 {
                return Err(format!(
                    "line {}: expected a label and {} values, got {line:?}",
                    number + 1,
                    series.len()
                ));
            }
            let values = fields[1..]
                .iter()
                .zip(&series)
                .map(|(field, name)| {
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
                })
                .collect::<Result<Vec<f64>, String>>()?;
            Ok(Row {
                label: fields[0].to_string(),
                values,
            })
        })
        .collect::<Result<Vec<Row>, String>>()?;
    Ok(Table {
        caption,
        series,
        rows,
    })
}

/// Draws grouped horizontal bars (log scale), a bar a series in each row, into a PNG.
pub fn draw(table: &Table, png: &Path) -> Result<(), String> {
    let (rows, lanes) = (&table.rows, table.series.len());
    if rows.is_empty() {
        return Err("the table has no rows".into());
    }
    register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| "the bundled font cannot be read".to_string())?;
    // Row k takes a unit a bar and one for the gap below them.
    let step = lanes as f64 + 1.0;
    let height = 80 + 18 * (lanes as u32 + 1) * rows.len() as u32;
    let root = BitMapBackend::new(png, (960, height)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| format!("{e}");
    root.fill(&WHITE).map_err(err)?;
    let values = || rows.iter().flat_map(|r| r.values.iter().copied());
    let max = values().fold(1.0, f64::max) * 2.0;
    // The axis starts at the power of ten at or below the smallest value (all are positive).
    let min = 10f64.powf(values().fold(f64::INFINITY, f64::min).log10().floor());
    let mut chart = ChartBuilder::on(&root)
        .caption(&table.caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(230)
        .build_cartesian_2d((min..max).log_scale(), 0.0..rows.len() as f64 * step)
        .map_err(|e| format!("{e}"))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|e| format!("{e}"))?;
    let top = rows.len() as f64 * step;
    let label = ("sans-serif", 13)
        .into_font()
        .into_text_style(&root)
        .pos(Pos::new(HPos::Right, VPos::Center));
    for (k, row) in rows.iter().enumerate() {
        let middle = top - step * k as f64 - lanes as f64 / 2.0;
        let (x, y) = chart.backend_coord(&(min, middle));
        root.draw(&Text::new(row.label.clone(), (x - 8, y), label.clone()))
            .map_err(err)?;
    }
    for (lane, name) in table.series.iter().enumerate() {
        let color = COLORS[COLORS.len() - lanes + lane];
        let bars = rows.iter().enumerate().map(move |(k, row)| {
            let y = top - step * k as f64 - lane as f64;
            Rectangle::new([(min, y - 1.0), (row.values[lane], y)], color.filled())
        });
        chart
            .draw_series(bars)
            .map_err(|e| format!("{e}"))?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
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
    fn parses_tables_and_names_bad_fields() {
        let table = parse("GPU us,sglang,kvplan\nplan 1 x 512,5.4,3.03\n\n").unwrap();
        assert_eq!(
            table,
            Table {
                caption: "GPU us".into(),
                series: vec!["sglang".into(), "kvplan".into()],
                rows: vec![Row {
                    label: "plan 1 x 512".into(),
                    values: vec![5.4, 3.03],
                }],
            }
        );
        assert_eq!(
            parse("h,a,b\nplan,5.4").unwrap_err(),
            "line 2: expected a label and 2 values, got \"plan,5.4\""
        );
        assert_eq!(
            parse("h,a,b\nplan,5.4,-1").unwrap_err(),
            "line 2: b \"-1\" is not a positive number"
        );
        assert_eq!(
            parse("caption only").unwrap_err(),
            "line 1: expected a caption and 1 to 4 series, got \"caption only\""
        );
        assert_eq!(parse("").unwrap_err(), "the table has no header");
        let empty = parse("h,a").unwrap();
        assert_eq!(
            draw(&empty, Path::new("/nonexistent.png")).unwrap_err(),
            "the table has no rows"
        );
    }

    #[test]
    fn draws_the_readmes_charts() {
        for csv in [
            include_str!("../../benches/h200.csv"),
            include_str!("../../benches/decoder-h100.csv"),
        ] {
            let table = parse(csv).unwrap();
            let path =
                std::env::temp_dir().join(format!("kvplan-chart-{}.png", std::process::id()));
            draw(&table, &path).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            std::fs::remove_file(&path).ok();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
            assert!(bytes.len() > 10_000, "{} bytes", bytes.len());
        }
    }
}
