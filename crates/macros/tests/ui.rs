//! Compile errors of `#[parallelize]`: each names the problem at the offending token, and is
//! the only error (the struct is still emitted, without an impl).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
