//! Line charts as SVG or PNG, for `replay --compare` and the benchmarks.
//!
//! Text is drawn with a small font bundled in the binary (`assets/fonts`,
//! DejaVu Sans cut to ASCII) through plotters' `ab_glyph` renderer, so charts
//! render on machines with no system fonts or font libraries.

use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Context, anyhow, bail};
use plotters::coord::Shift;
use plotters::prelude::*;

const FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSans-subset.ttf");
const FONT_FAMILY: &str = "sans-serif";
const SIZE: (u32, u32) = (960, 600);
const LEGEND_WIDTH: u32 = 190;
/// Tableau 10: distinct at a glance, and none too pale on white.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// One line of a chart.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed: reference bounds rather than measured contenders.
    pub dashed: bool,
}

/// A chart of lines over a shared x axis.
pub struct LineChart<'a> {
    pub title: String,
    pub x_label: &'a str,
    pub y_label: &'a str,
    /// A logarithmic x axis, for sizes that grow geometrically, with its ticks
    /// at the x values of the points.
    pub log_x: bool,
    pub y_range: Range<f64>,
    pub series: Vec<Series>,
}

/// Writes `chart` to `path`, as SVG or PNG by its extension.
pub fn write_line_chart(path: &Path, chart: &LineChart) -> anyhow::Result<()> {
    static FONT_REGISTERED: OnceLock<bool> = OnceLock::new();
    let registered = *FONT_REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, FONT).is_ok()
    });
    if !registered {
        bail!("the bundled chart font is not a valid TrueType font");
    }

    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let drawn = match extension.to_ascii_lowercase().as_str() {
        "svg" => draw(SVGBackend::new(path, SIZE).into_drawing_area(), chart),
        "png" => draw(BitMapBackend::new(path, SIZE).into_drawing_area(), chart),
        _ => bail!(
            "cannot draw chart {}: the file name must end in .svg or .png",
            path.display()
        ),
    };
    drawn.with_context(|| format!("cannot draw chart {}", path.display()))
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, chart: &LineChart) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let fail = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e}");
    root.fill(&WHITE).map_err(fail)?;
    let (plot, legend) = root.split_horizontally(SIZE.0 - LEGEND_WIDTH);
    draw_legend(&legend, &chart.series).map_err(fail)?;
    let (x_min, x_max) = x_bounds(&chart.series);
    let mut builder = ChartBuilder::on(&plot);
    builder
        .caption(&chart.title, (FONT_FAMILY, 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64);
    if chart.log_x {
        let mut ctx = builder
            .build_cartesian_2d(
                (x_min..x_max)
                    .log_scale()
                    .with_key_points(x_values(&chart.series)),
                chart.y_range.clone(),
            )
            .map_err(fail)?;
        draw_series(&mut ctx, chart).map_err(fail)?;
    } else {
        let mut ctx = builder
            .build_cartesian_2d(x_min..x_max, chart.y_range.clone())
            .map_err(fail)?;
        draw_series(&mut ctx, chart).map_err(fail)?;
    }
    root.present().map_err(fail)
}

fn draw_series<'a, DB, X>(
    ctx: &mut ChartContext<'a, DB, Cartesian2d<X, plotters::coord::types::RangedCoordf64>>,
    chart: &LineChart,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64> + plotters::coord::ranged1d::ValueFormatter<f64>,
{
    ctx.configure_mesh()
        .x_desc(chart.x_label)
        .y_desc(chart.y_label)
        .x_label_formatter(&|&x| tick_label(x))
        .y_label_formatter(&|&y| tick_label(y))
        .label_style((FONT_FAMILY, 15))
        .axis_desc_style((FONT_FAMILY, 17))
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(225, 225, 225))
        .draw()?;
    for (i, series) in chart.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let style = color.stroke_width(3);
        let points = series.points.iter().copied();
        if series.dashed {
            ctx.draw_series(DashedLineSeries::new(points.clone(), 10, 6, style))?;
        } else {
            ctx.draw_series(LineSeries::new(points.clone(), style))?;
        }
        ctx.draw_series(points.map(|p| Circle::new(p, 4, color.filled())))?;
    }
    Ok(())
}

/// The legend, in its own column beside the plot so it never hides a line.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    series: &[Series],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let top = 70;
    for (i, series) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let y = top + 28 * i as i32;
        let swatch = [(8, y), (40, y)];
        if series.dashed {
            area.draw(&PathElement::new([(8, y), (20, y)], color.stroke_width(3)))?;
            area.draw(&PathElement::new([(28, y), (40, y)], color.stroke_width(3)))?;
        } else {
            area.draw(&PathElement::new(swatch, color.stroke_width(3)))?;
        }
        area.draw(&Text::new(
            series.name.as_str(),
            (48, y - 9),
            (FONT_FAMILY, 16).into_font(),
        ))?;
    }
    Ok(())
}

/// Distinct x values of all points, ascending.
/// A tick's value with as few decimals as tell it apart: 1, 1.5, 0.25
/// (rounding to whole numbers labelled the ticks 1, 1.5, 2 as "1 2 2").
fn tick_label(value: f64) -> String {
    let text = format!("{value:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn x_values(series: &[Series]) -> Vec<f64> {
    let mut xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    xs
}

/// The x range covering every point, widened when it would be empty.
fn x_bounds(series: &[Series]) -> (f64, f64) {
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    if !lo.is_finite() || !hi.is_finite() {
        (1.0, 2.0)
    } else if lo == hi {
        (lo * 0.5, hi * 2.0)
    } else {
        // A little air so end points and their markers are not clipped.
        let pad = if lo > 0.0 { 1.1 } else { 1.0 };
        (lo / pad, hi * pad)
    }
}

#[cfg(test)]
mod tests {
    use super::tick_label;

    #[test]
    fn tick_labels_keep_the_decimals_that_tell_ticks_apart() {
        let labels: Vec<String> = [1.0, 1.5, 2.0, 0.25, 10.0, 2.999]
            .into_iter()
            .map(tick_label)
            .collect();
        assert_eq!(labels, ["1", "1.5", "2", "0.25", "10", "3"]);
    }
}
