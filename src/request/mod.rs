//! What the router reads from a client's request before routing it: its body, bounded
//! ([`body`]); used by the proxy and the admin API alike.

pub mod body;
