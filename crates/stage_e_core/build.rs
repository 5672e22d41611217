//! Declares the `loom` cfg (`RUSTFLAGS="--cfg loom"`: the protocols' model checks, `sync`), so
//! that rustc's check of cfg names knows it.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(loom)");
}
