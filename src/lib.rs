//! cellgraph: a graph-mode deep-learning compiler and runtime built around gradient
//! accumulation, in the MindSpore style.
//!
//! ```
//! use cellgraph::prelude::*;
//!
//! // Trace LeNet5 with its loss, differentiate it, and compile the training step.
//! let net = WithLossCell::new(LeNet5::new(&Scope::root(), 10, 1), SoftmaxCrossEntropyWithLogits::new(true, Reduction::Mean));
//! let inputs = [("data", TensorType::f32([32, 1, 32, 32])), ("label", TensorType::i32([32]))];
//! let step = train_one_step(&net, &inputs, &SGD::new(0.01)).unwrap();
//! let exe = compile(step.graph).unwrap();
//! assert!(exe.len() > 40);
//! ```

pub use cellgraph_cells as cells;
pub use cellgraph_compiler as compiler;
pub use cellgraph_runtime as runtime;

/// Everything a training script needs.
pub mod prelude {
    pub use cellgraph_cells::{
        grad_graph, materialize, trace, train_one_step, Adam, Cell, CrossEntropyLoss, Dense, Flatten, Initializer, LeNet5, LearningRate, MSELoss,
        Momentum, Network, Parameter, Pool2d, ReLU, Scope, SequentialCell, SoftmaxCrossEntropyWithLogits, Tracer, WithLossCell, SGD,
    };
    pub use cellgraph_cells::{AdaptiveAvgPool2d, AutoParallel, BatchNorm2d, Conv2d, Optimizer, ResNet18};
    pub use cellgraph_cells::{Embedding, GptConfig, LayerNorm, Llama, LlamaConfig, RMSNorm, SiLU, Softmax, GELU, GPT};
    pub use cellgraph_cells::{GradAccumulation, LossScale, Normalization, Precision};
    pub use cellgraph_compiler::autodiff::Sens;
    pub use cellgraph_compiler::{parse, print, verify, DType, Graph, HostData, HostTensor, NodeId, Op, PadMode, Reduction, Shape, TensorType};
    pub use cellgraph_runtime::data::{lenet_transform, Mnist};
    pub use cellgraph_runtime::{
        compile, cpu, Callback, CheckpointConfig, Cpu, Dataset, Executable, LossMonitor, Model, ModelCheckpoint, Session, TensorDataset, TimeMonitor,
    };
}

/// The end of a program's `main`: `Ok` exits 0; an error is printed as a sentence
/// (`error: data/mnist/train-images-idx3-ubyte: ...`, its `Display`, never its `Debug`) and
/// exits 1.
pub fn exit_with(result: Result<(), Box<dyn std::error::Error>>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The `main` of a program that may run under `mpirun`: joins the compute thread pool, starts
/// the communicator (a world of one without mpirun; exit status 2 if it cannot start), runs
/// `run`, and ends as [`exit_with`]; under several ranks a failing rank prints its error with
/// its rank and takes the whole job down (the others may be waiting in a collective).
pub fn main_on_ranks(
    run: impl FnOnce(std::sync::Arc<dyn runtime::comm::Communicator>) -> Result<(), Box<dyn std::error::Error>>,
) -> std::process::ExitCode {
    runtime::join_thread_pool();
    let comm = match runtime::comm::init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let result = run(comm.clone());
    if comm.size() > 1 {
        if let Err(e) = &result {
            eprintln!("rank {}: error: {e}", comm.rank());
            comm.abort(1);
        }
    }
    exit_with(result)
}
