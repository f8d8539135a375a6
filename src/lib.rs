pub use cellgraph_compiler as compiler;
