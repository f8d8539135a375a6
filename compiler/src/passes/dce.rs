//! Dead-code elimination: removes nodes that no output and no effect depends on.

use std::collections::HashSet;

use crate::graph::Graph;

/// Removes every node that is neither an output, an effect (assign, assign_add), nor an
/// operand of one transitively. Returns how many nodes were removed.
pub fn dce(g: &mut Graph) -> usize {
    let mut live: HashSet<_> = g.outputs().iter().copied().collect();
    let mut stack: Vec<_> = live.iter().copied().chain(g.effects()).collect();
    live.extend(stack.iter().copied());
    while let Some(n) = stack.pop() {
        for o in g.operands(n) {
            if live.insert(o) {
                stack.push(o);
            }
        }
    }
    let dead: Vec<_> = g.ids().into_iter().filter(|id| !live.contains(id)).collect();
    for &d in &dead {
        g.remove(d);
    }
    dead.len()
}
