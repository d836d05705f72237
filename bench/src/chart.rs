//! The picture beside `trace-matrix`'s table: for each contender, the distribution of
//! time to first token (a CDF on a log axis) and the prefix-cache hit rate (a bar).
//! Drawn with plotters' SVG backend alone: text is left to the SVG viewer's fonts, so
//! nothing here reads a font file or needs a system library.

use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::matrix::ContenderRun;

/// Width and height of the picture, in SVG pixels.
const SIZE: (u32, u32) = (1000, 440);
/// Points drawn per CDF: enough for a smooth curve, few enough for a small file.
const CDF_POINTS: usize = 400;
/// The contender without timings of its own (one engine, time factor 0).
const REFERENCE_ONLY: &str = "ideal";

/// One contender as drawn: its label, TTFTs (ms, any order) and hit rate.
struct Drawn<'a> {
    label: &'a str,
    ttft_ms: &'a [f64],
    hit_rate: f64,
}

/// The SVG text of the picture for the contenders that ran (failed ones are left out).
/// `subtitle` says what was replayed, on what. Errors: no contender ran, or plotters
/// failed to draw (the message says which).
pub fn render_svg(
    rows: &[(String, Result<ContenderRun, String>)],
    subtitle: &str,
) -> Result<String, String> {
    let drawn: Vec<Drawn<'_>> = rows
        .iter()
        .filter_map(|(label, row)| {
            row.as_ref().ok().map(|run| Drawn {
                label,
                ttft_ms: &run.ttft_ms,
                hit_rate: run.summary.hit_rate,
            })
        })
        .collect();
    if drawn.is_empty() {
        return Err("no contender ran: nothing to draw".into());
    }
    let mut svg = String::new();
    draw(&drawn, subtitle, &mut svg).map_err(|e| format!("drawing the picture: {e}"))?;
    Ok(svg)
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn draw(drawn: &[Drawn<'_>], subtitle: &str, svg: &mut String) -> DrawResult {
    let root = SVGBackend::with_string(svg, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        "Time to first token and hit rate, per policy",
        ("sans-serif", 20),
    )?;
    let (body, foot) = root.split_vertically(SIZE.1 - 60);
    foot.draw_text(
        subtitle,
        &("sans-serif", 13).into_font().color(&BLACK.mix(0.7)),
        (12, 20),
    )?;
    let (left, right) = body.split_horizontally(SIZE.0 * 62 / 100);
    draw_cdf(&left, drawn)?;
    draw_hit_rates(&right, drawn)?;
    root.present()?;
    Ok(())
}

/// Tableau's ten colours: distinct on white and for the common colour blindnesses.
const PALETTE: [RGBColor; 10] = [
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

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// Up to [`CDF_POINTS`] (TTFT, share of requests at or under it) points, sorted.
fn cdf(ttft_ms: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = ttft_ms.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(CDF_POINTS).max(1);
    let mut points: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (v[i], (i + 1) as f64 / n as f64))
        .collect();
    points.push((v[n - 1], 1.0));
    points
}

fn draw_cdf<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    drawn: &[Drawn<'_>],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    // (colour index, label, points)
    let curves: Vec<_> = drawn
        .iter()
        .enumerate()
        .filter(|(_, d)| d.label != REFERENCE_ONLY)
        .map(|(i, d)| (i, d.label, cdf(d.ttft_ms)))
        .filter(|(_, _, c)| !c.is_empty())
        .collect();
    let lowest = curves
        .iter()
        .filter_map(|(_, _, c)| c.first().map(|p| p.0))
        .fold(f64::INFINITY, f64::min);
    let highest = curves
        .iter()
        .filter_map(|(_, _, c)| c.last().map(|p| p.0))
        .fold(0.0, f64::max);
    // A log axis: TTFTs span two or three decades (cache hits vs queued prefills).
    let lo = if lowest.is_finite() {
        (lowest / 1.2).max(1.0)
    } else {
        1.0
    };
    let hi = (highest * 1.2).max(lo * 10.0);
    let mut chart = ChartBuilder::on(area)
        .caption("TTFT distribution (CDF)", ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("time to first token (ms, log scale)")
        .y_desc("share of requests at or under")
        .y_label_formatter(&|y| format!("{:.0} %", 100.0 * y))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()?;
    for (i, label, points) in curves {
        let style = color(i).stroke_width(2);
        let points = points.into_iter().map(|(x, y)| (x.max(lo), y));
        chart
            .draw_series(LineSeries::new(points, style))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 13))
        .draw()?;
    Ok(())
}

fn draw_hit_rates<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    drawn: &[Drawn<'_>],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let top = drawn.iter().map(|d| d.hit_rate).fold(0.0, f64::max);
    let y_max = if top > 0.0 { top * 1.25 } else { 1.0 };
    let labels: Vec<&str> = drawn.iter().map(|d| d.label).collect();
    let mut chart = ChartBuilder::on(area)
        .caption("prefix-cache hit rate", ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(48)
        // An integer range counts its end as a value: 0..n-1 holds n bars.
        .build_cartesian_2d((0..drawn.len() - 1).into_segmented(), 0.0..y_max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_desc("Σ cached ÷ Σ prompt tokens")
        .x_labels(drawn.len())
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).copied().unwrap_or("").to_string(),
            _ => String::new(),
        })
        .y_label_formatter(&|y| format!("{y:.2}"))
        .draw()?;
    chart.draw_series(drawn.iter().enumerate().map(|(i, d)| {
        let mut bar = Rectangle::new(
            [
                (SegmentValue::Exact(i), 0.0),
                (SegmentValue::Exact(i + 1), d.hit_rate),
            ],
            color(i).filled(),
        );
        bar.set_margin(0, 0, 10, 10);
        bar
    }))?;
    chart.draw_series(drawn.iter().enumerate().map(|(i, d)| {
        Text::new(
            format!("{:.3}", d.hit_rate),
            (SegmentValue::CenterOf(i), d.hit_rate + y_max * 0.01),
            ("sans-serif", 13)
                .into_font()
                .into_text_style(area)
                .pos(Pos::new(HPos::Center, VPos::Bottom)),
        )
    }))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Summary;

    fn run(hit_rate: f64, ttft_ms: Vec<f64>) -> Result<ContenderRun, String> {
        Ok(ContenderRun {
            summary: Summary {
                hit_rate,
                ..Summary::default()
            },
            router: None,
            how: String::new(),
            other_cpu: None,
            routers: 1,
            fleet: None,
            ttft_ms,
            pd: None,
            engine_itl_ms: None,
        })
    }

    #[test]
    fn the_picture_names_each_contender_that_ran_and_its_hit_rate() {
        let rows = vec![
            (
                "cache_aware".to_string(),
                run(0.177, vec![90.0, 110.0, 870.0]),
            ),
            (
                "round_robin".to_string(),
                run(0.081, vec![150.0, 200.0, 1300.0]),
            ),
            ("least_load".to_string(), Err("could not start".to_string())),
        ];
        let svg = render_svg(&rows, "2000 requests").unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        for text in [
            "cache_aware",
            "round_robin",
            "0.177",
            "0.081",
            "2000 requests",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }
        assert!(!svg.contains("least_load"));
    }

    #[test]
    fn nothing_to_draw_is_an_error_not_an_empty_picture() {
        let rows = vec![("cache_aware".to_string(), Err("boom".to_string()))];
        assert!(render_svg(&rows, "").is_err());
    }

    #[test]
    fn the_cdf_is_sorted_bounded_and_ends_at_every_request() {
        let v: Vec<f64> = (0..1000).rev().map(f64::from).collect();
        let c = cdf(&v);
        assert!(c.len() <= CDF_POINTS + 1);
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
        assert_eq!(c.last(), Some(&(999.0, 1.0)));
    }
}
