//! cellgraph's user-facing Cell API, in MindSpore's names and semantics.
//!
//! - [`cell`]: the `Cell` trait and the tracer.
//! - [`param`] and [`init`]: parameters, naming scopes, initializers.
//! - [`layers`], [`norm`], [`transformer`], [`loss`], [`zoo`]: building blocks and reference
//!   networks.
//! - [`optim`] and [`train`]: optimizers and training-graph builders.

pub mod accumulate;
pub mod cell;
pub mod error;
pub mod init;
pub mod layers;
pub mod llama;
pub mod loss;
pub mod norm;
pub mod optim;
pub mod param;
pub mod schedule;
pub mod train;
pub mod transformer;
pub mod zoo;

pub use accumulate::{AutoParallel, GradAccumulation, LossScale, Normalization, Precision, Slicing};
pub use cell::{trace, Cell, Tracer};
pub use error::{CellError, Result};
pub use init::Initializer;
pub use layers::{AdaptiveAvgPool2d, AvgPool2d, Conv2d, Dense, Dropout, Flatten, MaxPool2d, Pool2d, ReLU, SequentialCell};
pub use llama::{Llama, LlamaAttention, LlamaBlock, LlamaConfig, LlamaMlp, RMSNorm, SiLU};
pub use loss::{CrossEntropyLoss, MSELoss, SoftmaxCrossEntropyWithLogits, WithLossCell};
pub use norm::BatchNorm2d;
pub use optim::{Adam, Momentum, Optimizer, SGD};
pub use param::{materialize, Parameter, Scope};
pub use schedule::LearningRate;
pub use train::{grad_graph, train_one_step, GradGraph, TrainStep};
pub use transformer::{Block, CausalSelfAttention, Embedding, LayerNorm, Mlp, Softmax, GELU};
pub use zoo::{BasicBlock, GptConfig, LeNet5, Network, ResNet18, GPT};
