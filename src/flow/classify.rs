//! Who a request is and how urgent: its tenant (a header, or its API key mapped to a
//! name; else `default`) and its class (a header, or the body's vLLM `priority`; else
//! the default class), clamped to the tenant's `max_class`; with
//! `tenants.isolate_cache`, the tenant's `cache_salt`. Pure: no locks, no allocation
//! per request.

use std::collections::HashMap;
use std::sync::Arc;

use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::config::{Config, DEFAULT_TENANT, OTHER_TENANT, PriorityConfig};

/// A request's tenant and class, as indices into [`Classifier::tenant_name`] and
/// [`Classifier::class_name`] (0 is the most urgent class).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Ticket {
    pub tenant: u16,
    pub class: u8,
}

/// One known tenant (a `tenants.list` entry, `default` or `other`).
#[derive(Debug)]
struct Tenant {
    name: Arc<str>,
    /// Its most urgent allowed class.
    max_class: u8,
    /// Named by an API key only (it has keys): a header naming it is not believed.
    keyed: bool,
    /// `weight` (its share within a class).
    weight: u32,
    /// `tenants.isolate_cache`: its `cache_salt`, as a JSON string.
    salt: Option<Box<str>>,
}

/// The `cache_salt` of tenant `name` under `secret`: HMAC-SHA256, its first 16 bytes in
/// hex (as a JSON string). Nobody without the secret can make another tenant's salt.
fn salt(secret: &str, name: &str) -> Box<str> {
    use hmac::{Hmac, Mac};
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret.as_bytes()) else {
        // HMAC takes a key of any length.
        return Box::from("\"\"");
    };
    mac.update(name.as_bytes());
    let tag = mac.finalize().into_bytes();
    let hex: String = tag[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("\"{hex}\"").into_boxed_str()
}

/// Resolves requests to [`Ticket`]s (see the module docs).
#[derive(Debug)]
pub struct Classifier {
    tenants: Vec<Tenant>,
    by_name: HashMap<Box<str>, u16>,
    by_key: HashMap<[u8; 32], u16>,
    default_tenant: u16,
    other_tenant: u16,
    tenant_header: http::HeaderName,
    classes: Vec<Arc<str>>,
    priority: PriorityConfig,
}

impl Classifier {
    /// The tenants of `tenants.list` (by name), then `default` and `other` unless
    /// listed; the classes of `priority.classes`.
    pub fn new(config: &Config) -> Self {
        let mut tenants: Vec<Tenant> = config
            .tenants
            .list
            .iter()
            .map(|t| Tenant {
                name: Arc::from(t.name.as_str()),
                max_class: t.max_class as u8,
                keyed: !t.api_key_sha256.is_empty(),
                weight: t.weight,
                salt: None,
            })
            .collect();
        for name in [DEFAULT_TENANT, OTHER_TENANT] {
            if !tenants.iter().any(|t| &*t.name == name) {
                tenants.push(Tenant {
                    name: Arc::from(name),
                    max_class: 0,
                    keyed: false,
                    weight: 1,
                    salt: None,
                });
            }
        }
        if let (true, Some(secret)) = (config.tenants.isolate_cache, &config.tenants.secret) {
            for t in &mut tenants {
                t.salt = Some(salt(secret.expose(), &t.name));
            }
        }
        let by_name: HashMap<Box<str>, u16> = tenants
            .iter()
            .enumerate()
            .map(|(i, t)| (Box::from(&*t.name), i as u16))
            .collect();
        let mut by_key = HashMap::new();
        for (i, t) in config.tenants.list.iter().enumerate() {
            for k in &t.api_key_sha256 {
                by_key.insert(*k, i as u16);
            }
        }
        Classifier {
            default_tenant: by_name[DEFAULT_TENANT],
            other_tenant: by_name[OTHER_TENANT],
            tenants,
            by_name,
            by_key,
            tenant_header: config.tenants.header.clone(),
            classes: config
                .priority
                .classes
                .iter()
                .map(|c| Arc::from(c.as_str()))
                .collect(),
            priority: config.priority.clone(),
        }
    }

    /// The request's ticket: its tenant from its headers, its class from the class
    /// header, else `body_priority` (the body's vLLM `priority`), else the default
    /// class; never more urgent than the tenant's `max_class`.
    pub fn ticket(&self, headers: &HeaderMap, body_priority: Option<i64>) -> Ticket {
        let tenant = self.tenant(headers);
        let asked = headers
            .get(&self.priority.header)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| self.class_of_header(v.trim()))
            .or_else(|| body_priority.map(|p| self.priority.class_of_engine(p)))
            .unwrap_or(self.priority.default);
        let floor = self.tenants[tenant as usize].max_class as usize;
        Ticket {
            tenant,
            class: asked.max(floor) as u8,
        }
    }

    /// A class header's value: a class name, or an integer in vLLM's sense.
    fn class_of_header(&self, v: &str) -> Option<usize> {
        self.priority.class(v).or_else(|| {
            v.parse::<i64>()
                .ok()
                .map(|p| self.priority.class_of_engine(p))
        })
    }

    /// The tenant a request's API key names; else the one its tenant header names
    /// (a listed tenant without keys; any other name is `other`); else `default`.
    fn tenant(&self, headers: &HeaderMap) -> u16 {
        if !self.by_key.is_empty()
            && let Some(key) = api_key(headers)
            && let Some(t) = self.by_key.get(&<[u8; 32]>::from(Sha256::digest(key)))
        {
            return *t;
        }
        let Some(named) = headers.get(&self.tenant_header) else {
            return self.default_tenant;
        };
        match named.to_str().ok().and_then(|n| self.by_name.get(n.trim())) {
            Some(&t) if !self.tenants[t as usize].keyed => t,
            _ => self.other_tenant,
        }
    }

    /// `tenants.isolate_cache`: the `cache_salt` of `tenant`, as a JSON string.
    pub fn salt(&self, tenant: u16) -> Option<&str> {
        self.tenants[tenant as usize].salt.as_deref()
    }

    /// vLLM's `priority` for `class` ([`PriorityConfig::engine_of_class`]).
    pub fn engine_priority(&self, class: u8) -> i64 {
        self.priority.engine_of_class(class as usize)
    }

    pub fn tenant_name(&self, tenant: u16) -> &Arc<str> {
        &self.tenants[tenant as usize].name
    }

    pub fn class_name(&self, class: u8) -> &Arc<str> {
        &self.classes[class as usize]
    }

    /// How many tenants and classes there are (the tables' sizes).
    pub fn tenants(&self) -> usize {
        self.tenants.len()
    }

    pub fn classes(&self) -> usize {
        self.classes.len()
    }

    /// Each tenant's `weight`, by index.
    pub fn weights(&self) -> Vec<u32> {
        self.tenants.iter().map(|t| t.weight).collect()
    }

    /// The ticket of a request no header names: `default` tenant, default class.
    pub fn default_ticket(&self) -> Ticket {
        Ticket {
            tenant: self.default_tenant,
            class: (self.priority.default as u8)
                .max(self.tenants[self.default_tenant as usize].max_class),
        }
    }
}

/// The caller's API key: `Authorization: Bearer KEY`, else `x-api-key: KEY`.
fn api_key(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(v) = headers.get(http::header::AUTHORIZATION) {
        let v = v.as_bytes();
        if v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ") {
            return Some(v[7..].trim_ascii());
        }
    }
    headers.get("x-api-key").map(|v| v.as_bytes().trim_ascii())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::load_text;

    fn hex(key: &str) -> String {
        Sha256::digest(key.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn classifier() -> Classifier {
        let yaml = format!(
            "workers: [\"http://127.0.0.1:1\"]\npriority: {{}}\ntenants:\n  list:\n    acme: {{max_class: interactive}}\n    keyed: {{api_key_sha256: [\"{}\"], max_class: batch}}\n",
            hex("sk-keyed")
        );
        Classifier::new(&load_text(&yaml).unwrap())
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    fn named(c: &Classifier, h: &[(&'static str, &str)], body: Option<i64>) -> (String, String) {
        let t = c.ticket(&headers(h), body);
        (
            c.tenant_name(t.tenant).to_string(),
            c.class_name(t.class).to_string(),
        )
    }

    #[test]
    fn tenants_come_from_the_key_then_the_header_then_default() {
        let c = classifier();
        let n = |h: &[(&'static str, &str)]| named(&c, h, None).0;
        assert_eq!(n(&[]), "default");
        assert_eq!(n(&[("x-tenant-id", "acme")]), "acme");
        assert_eq!(n(&[("x-tenant-id", "nobody")]), "other");
        // A keyed tenant is named by its key only.
        assert_eq!(n(&[("x-tenant-id", "keyed")]), "other");
        assert_eq!(n(&[("authorization", "Bearer sk-keyed")]), "keyed");
        assert_eq!(
            n(&[("x-api-key", "sk-keyed"), ("x-tenant-id", "acme")]),
            "keyed"
        );
        assert_eq!(n(&[("authorization", "Bearer sk-wrong")]), "default");
    }

    #[test]
    fn each_tenant_has_its_own_salt_under_the_secret() {
        let yaml = "workers: [\"http://127.0.0.1:1\"]\ntenants: {isolate_cache: true, secret: s3cret, list: {a: {}, b: {}}}\n";
        let c = Classifier::new(&load_text(yaml).unwrap());
        let salts: Vec<&str> = (0..c.tenants() as u16)
            .map(|t| c.salt(t).unwrap())
            .collect();
        assert_eq!(salts.len(), 4, "a, b, default, other");
        for (i, s) in salts.iter().enumerate() {
            assert_eq!(s.len(), 34, "{s}");
            assert!(!salts[..i].contains(s));
        }
        let other = Classifier::new(&load_text(&yaml.replace("s3cret", "other")).unwrap());
        assert_ne!(other.salt(0), c.salt(0), "the secret keys the hash");
        assert_eq!(classifier().salt(0), None);
    }

    #[test]
    fn classes_come_from_the_header_then_the_body_and_are_clamped() {
        let c = classifier();
        let class = |h: &[(&'static str, &str)], body| named(&c, h, body).1;
        assert_eq!(class(&[], None), "standard");
        assert_eq!(class(&[("x-priority", "batch")], None), "batch");
        assert_eq!(class(&[("x-priority", "critical")], Some(1)), "critical");
        assert_eq!(class(&[], Some(-1)), "interactive");
        assert_eq!(class(&[], Some(7)), "batch");
        assert_eq!(class(&[("x-priority", "-2")], None), "critical");
        // An unknown name falls back to the body, then the default.
        assert_eq!(class(&[("x-priority", "urgent")], Some(1)), "batch");
        // Clamped to the tenant's max_class.
        let acme = ("x-tenant-id", "acme");
        assert_eq!(
            class(&[acme, ("x-priority", "critical")], None),
            "interactive"
        );
        let keyed = ("authorization", "Bearer sk-keyed");
        assert_eq!(class(&[keyed, ("x-priority", "critical")], None), "batch");
    }
}
