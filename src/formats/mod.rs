//! Number formats (stub).
