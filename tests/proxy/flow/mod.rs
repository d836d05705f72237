//! Flow control (`tenants:`, `priority:`): who a request is and how urgent, as the
//! worker and the client see it.

mod classes;
