//! The pass pipeline: a flat list of named passes, verified after each one.

use crate::error::Result;
use crate::graph::Graph;
use crate::verify::verify;

/// A named rewrite of one graph.
pub struct Pass {
    pub name: &'static str,
    pub run: fn(&mut Graph) -> Result<()>,
}

/// Options for [`run`] and [`passes`].
#[derive(Clone, Debug)]
pub struct PipelineOptions {
    /// Verify after each pass (on by default in debug builds).
    pub verify: bool,
    /// Fuse elementwise chains, then fuse them onto the ops that produce their input
    /// (epilogues), then the accumulation of weight gradients onto the ops that produce
    /// them; on by default, off gives the unfused reference plan.
    pub fuse: bool,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions { verify: cfg!(debug_assertions), fuse: true }
    }
}

/// The passes run on every graph before lowering: dead code, then (unless `opts.fuse` is
/// off) elementwise fusion, epilogue fusion and accumulation fusion.
pub fn passes(opts: &PipelineOptions) -> Vec<Pass> {
    let mut v = vec![Pass {
        name: "dce",
        run: |g| {
            super::dce::dce(g);
            Ok(())
        },
    }];
    if opts.fuse {
        v.push(Pass {
            name: "fuse_elementwise",
            run: |g| {
                super::fuse::fuse_elementwise(g);
                Ok(())
            },
        });
        v.push(Pass {
            name: "fuse_epilogue",
            run: |g| {
                super::epilogue::fuse_epilogues(g);
                Ok(())
            },
        });
        v.push(Pass {
            name: "fuse_accumulation",
            run: |g| {
                super::epilogue::fuse_accumulation(g);
                Ok(())
            },
        });
    }
    v
}

/// Runs `passes` in order on `g`, calling `observe(index, name, graph)` after each (dumps hook
/// in here). The input is always verified; each pass's output when `opts.verify` asks.
pub fn run(g: &mut Graph, passes: &[Pass], opts: &PipelineOptions, mut observe: impl FnMut(usize, &str, &Graph)) -> Result<()> {
    // The passes assume a well-formed input: checked in every build.
    verify(g)?;
    observe(0, "input", g);
    for (i, p) in passes.iter().enumerate() {
        (p.run)(g)?;
        if opts.verify {
            verify(g)?;
        }
        observe(i + 1, p.name, g);
    }
    Ok(())
}
