//! `hedge:` — a streamed request whose first token is late is sent to a second worker as
//! well; the first to answer wins (see `crate::proxy::hedge`).

use std::time::Duration;

use serde::Deserialize;

use super::check::{Checker, ConfigError};
use super::difference::Section;

/// `hedge: {after_ms, max_share, classes}`.
#[derive(Debug, Clone, PartialEq)]
pub struct HedgeConfig {
    /// How long a streamed request waits for its first token before a second worker is
    /// asked too; `None` (the default): never hedged.
    pub after: Option<Duration>,
    /// Most requests hedged, as a share of the streamed requests (default 0.05).
    pub max_share: f64,
    /// The priority classes hedged (default `[critical, interactive]`) with flow
    /// control on; with it off every streamed request may be.
    pub classes: Vec<String>,
}

impl Default for HedgeConfig {
    fn default() -> Self {
        HedgeConfig {
            after: None,
            max_share: 0.05,
            classes: vec!["critical".into(), "interactive".into()],
        }
    }
}

impl Section for HedgeConfig {
    const KEY: &'static str = "hedge";
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of keys")]
pub(super) struct RawHedge {
    after_ms: Option<u64>,
    max_share: Option<f64>,
    classes: Option<Vec<String>>,
}

impl RawHedge {
    pub(super) fn validate(self, ck: &Checker<'_>) -> Result<HedgeConfig, ConfigError> {
        let d = HedgeConfig::default();
        let after = match self.after_ms {
            None => None,
            Some(ms) if (1..=600_000).contains(&ms) => Some(Duration::from_millis(ms)),
            Some(ms) => {
                return Err(ck.bad(
                    "hedge.after_ms",
                    ms,
                    "is out of range (ms, 1 to 600000; leave it unset for no hedging)",
                ));
            }
        };
        let max_share = self.max_share.unwrap_or(d.max_share);
        if !(0.0..=1.0).contains(&max_share) {
            return Err(ck.bad(
                "hedge.max_share",
                max_share,
                "is out of range (a share of the streamed requests, 0 to 1)",
            ));
        }
        let classes = self.classes.unwrap_or(d.classes);
        if let Some((i, c)) = classes.iter().enumerate().find(|(_, c)| c.is_empty()) {
            return Err(ck.bad(&format!("hedge.classes[{i}]"), c, "is empty"));
        }
        Ok(HedgeConfig {
            after,
            max_share,
            classes,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::load_text as load;
    use crate::config::testing::ONE;

    #[test]
    fn off_by_default_and_bad_values_name_their_key() {
        let c = load(ONE).unwrap();
        assert_eq!(c.hedge.after, None);
        assert_eq!(c.hedge.max_share, 0.05);
        assert_eq!(c.hedge.classes, ["critical", "interactive"]);
        let c = load(&format!(
            "hedge: {{after_ms: 300, max_share: 0.1, classes: [batch]}}\n{ONE}"
        ))
        .unwrap();
        assert_eq!(c.hedge.after, Some(Duration::from_millis(300)));
        assert_eq!(
            (c.hedge.max_share, c.hedge.classes),
            (0.1, vec!["batch".to_string()])
        );
        for (bad, key) in [
            ("{after_ms: 0}", "hedge.after_ms"),
            ("{max_share: 1.5}", "hedge.max_share"),
            ("{classes: [\"\"]}", "hedge.classes[0]"),
        ] {
            let e = load(&format!("hedge: {bad}\n{ONE}")).unwrap_err();
            assert!(e.contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn with_flow_control_the_hedged_classes_must_be_priority_classes() {
        let e = load(&format!(
            "hedge: {{after_ms: 300, classes: [interactive, urgent]}}\npriority: {{}}\n{ONE}"
        ))
        .unwrap_err();
        assert!(e.contains("hedge.classes[1]"), "{e}");
        assert!(e.contains("names no class of priority.classes"), "{e}");
        load(&format!("hedge: {{after_ms: 300}}\npriority: {{}}\n{ONE}")).unwrap();
    }
}
