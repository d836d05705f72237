//! The scenarios that change the fleet rather than the policy: several models on
//! separate or shared engines ([`ModelLayout`]), aggregated against disaggregated
//! workers, and their tables.

use std::fmt::Write as _;

use super::ContenderRun;

/// How the engines of a several-model run serve the models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelLayout {
    /// Engine `i` serves model `i mod M` only (two models on four engines: two each).
    Separate,
    /// Every engine serves every model, from one KV cache (a model's prompts never hit
    /// another's blocks).
    Shared,
}

impl ModelLayout {
    /// `separate` or `shared` (what [`std::str::FromStr`] reads).
    pub fn as_str(self) -> &'static str {
        match self {
            ModelLayout::Separate => "separate",
            ModelLayout::Shared => "shared",
        }
    }

    /// The models engine `i` serves, comma-separated as `sim-engine --model` reads them.
    pub fn engine_models(self, models: &[String], i: usize) -> String {
        match self {
            ModelLayout::Separate if !models.is_empty() => models[i % models.len()].clone(),
            _ => models.join(","),
        }
    }
}

impl std::fmt::Display for ModelLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ModelLayout {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "separate" => Ok(ModelLayout::Separate),
            "shared" => Ok(ModelLayout::Shared),
            other => Err(format!(
                "unknown model layout {other:?}: use separate or shared"
            )),
        }
    }
}

/// One row of a scenario table: the layout (or fleet) it ran on, the contender's label,
/// its run or why it failed.
pub type ScenarioRow<'a> = (&'a str, &'a str, &'a Result<ContenderRun, String>);

/// The several-models table (markdown): per layout and contender, the requests, errors,
/// answers an engine gave for another model than asked ([`crate::replay::RequestResult::wrong_model`]:
/// must be 0), hit rate, TTFT, the spread of requests over the workers, and the requests
/// per model.
pub fn render_models_table(rows: &[ScenarioRow<'_>]) -> String {
    let mut t = String::from(
        "| engines | contender | requests | errors | wrong-model answers | hit rate | TTFT p50 / p99 (ms) | max/mean req per worker | requests per model |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    for (layout, label, row) in rows {
        match row {
            Ok(run) => {
                let s = &run.summary;
                let per_model: Vec<String> = s
                    .per_model
                    .iter()
                    .map(|(m, n)| format!("{m} {n}"))
                    .collect();
                let _ = writeln!(
                    t,
                    "| {layout} | {label} | {} | {} | {} | {:.3} | {:.0} / {:.0} | {:.2} | {} |",
                    s.requests,
                    s.errors,
                    s.wrong_model,
                    s.hit_rate,
                    s.ttft_ms.p50,
                    s.ttft_ms.p99,
                    s.max_over_mean,
                    per_model.join(", "),
                );
            }
            Err(e) => {
                let first = e.lines().next().unwrap_or("");
                let _ = writeln!(
                    t,
                    "| {layout} | {label} | – | – | – | – | – | – | failed: {first} |"
                );
            }
        }
    }
    t
}

/// The disaggregation table (markdown): per contender, its workers, requests, errors,
/// hit rate, TTFT, inter-token latency on the engines' clock and as the client measured
/// it, end-to-end latency (every time in simulated ms: the client's wall-clock ms ÷
/// `time_factor`), and for a disaggregated fleet the share of requests the router sent
/// without a prefill leg and what its requests did (`pd_requests_total` by path,
/// `pd_bypasses_total` by reason, during the replay).
pub fn render_pd_table(rows: &[ScenarioRow<'_>], time_factor: f64) -> String {
    let mut t = String::from(
        "| contender | workers | requests | errors | hit rate | TTFT p50 / p99 | ITL p50 / p99, engines' clock | ITL p50 / p99, at the client | end-to-end p50 / p99 | bypass share | requests by path |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    let sim = |ms: f64| {
        if time_factor > 0.0 {
            ms / time_factor
        } else {
            0.0
        }
    };
    for (workers, label, row) in rows {
        match row {
            Ok(run) => {
                let s = &run.summary;
                let (share, paths) = match &run.pd {
                    Some(pd) => {
                        let mut paths: Vec<String> = pd
                            .paths
                            .iter()
                            .filter(|(_, n)| **n > 0)
                            .map(|(p, n)| format!("{p} {n}"))
                            .collect();
                        let reasons: Vec<String> = pd
                            .bypasses
                            .iter()
                            .filter(|(_, n)| **n > 0)
                            .map(|(r, n)| format!("{r} {n}"))
                            .collect();
                        if !reasons.is_empty() {
                            paths.push(format!("(bypass: {})", reasons.join(", ")));
                        }
                        (
                            format!("{:.1} %", 100.0 * pd.bypass_share()),
                            paths.join(", "),
                        )
                    }
                    None => ("–".into(), "–".into()),
                };
                let engine_itl = run
                    .engine_itl_ms
                    .map_or("–".into(), |p| format!("{:.0} / {:.0}", p.p50, p.p99));
                let _ = writeln!(
                    t,
                    "| {label} | {workers} | {} | {} | {:.3} | {:.0} / {:.0} | {engine_itl} | {:.0} / {:.0} | {:.0} / {:.0} | {share} | {paths} |",
                    s.requests,
                    s.errors,
                    s.hit_rate,
                    sim(s.ttft_ms.p50),
                    sim(s.ttft_ms.p99),
                    sim(s.itl_ms.p50),
                    sim(s.itl_ms.p99),
                    sim(s.latency_ms.p50),
                    sim(s.latency_ms.p99),
                );
            }
            Err(e) => {
                let first = e.lines().next().unwrap_or("");
                let _ = writeln!(
                    t,
                    "| {label} | {workers} | – | – | – | – | – | – | – | – | failed: {first} |"
                );
            }
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_give_each_engine_its_models() {
        let m = ["a".to_string(), "b".to_string()];
        let sep: Vec<String> = (0..4)
            .map(|i| ModelLayout::Separate.engine_models(&m, i))
            .collect();
        assert_eq!(sep, ["a", "b", "a", "b"]);
        assert_eq!(ModelLayout::Shared.engine_models(&m, 3), "a,b");
        assert_eq!("shared".parse::<ModelLayout>(), Ok(ModelLayout::Shared));
        assert!("both".parse::<ModelLayout>().is_err());
    }
}
