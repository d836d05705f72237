//! Flow control (`tenants:`, `priority:`): who a request is and how urgent, the
//! admission queue by class and tenant, pre-emption, as the worker and the client see
//! them.

mod budgets;
mod classes;
mod isolation;
mod preempt;
mod queue;
mod visible;
