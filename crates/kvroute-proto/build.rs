//! Compiles `proto/kvroute.proto` with protox (pure Rust), so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../proto");
    let proto = format!("{proto_dir}/kvroute.proto");
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([&proto], [proto_dir])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
