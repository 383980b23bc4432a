//! Compiles `proto/kvroute.proto` with protox (pure Rust), so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time, not baked in with env!(): a build script compiled in
    // one checkout must not compile another checkout's proto.
    let proto_dir = format!("{}/../../proto", std::env::var("CARGO_MANIFEST_DIR")?);
    let proto = format!("{proto_dir}/kvroute.proto");
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([&proto], [&proto_dir])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
