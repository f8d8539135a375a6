//! cellgraph's integration tests, in one binary (one link instead of one per file).

mod common;

mod accumulation;
mod batchnorm;
mod binding;
mod cells;
mod cifar;
mod cli;
mod device;
mod dumps;
mod gpt;
mod gradcheck;
mod hf;
mod ir;
mod llama;
mod mnist;
mod model;
mod mpi;
mod parallel;
mod precision;
mod programs;
mod runtime;
mod structure;
