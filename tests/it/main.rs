//! cellgraph's integration tests, in one binary (one link instead of one per file).

mod common;

mod accumulation;
mod cells;
mod cli;
mod device;
mod dumps;
mod gradcheck;
mod ir;
mod mnist;
mod model;
mod mpi;
mod parallel;
mod programs;
mod runtime;
