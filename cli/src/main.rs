//! The `kvstream` binary.
fn main() {
    println!("kvstream");
}
