"""MindSpore 2.10's nn.BatchNorm2d on fixed inputs: the reference values of
tests/it/batchnorm.rs (`batch_norm_matches_mindspore`). Run in a throwaway virtual
environment with `pip install mindspore==2.10.0 "numpy<2"`; prints the numbers the test holds.
Inputs: x1 = sin(0.37 i) * 2 + 0.5, x2 = cos(0.21 i) * 1.5 - 0.25, cotangent weights
w = sin(0.11 i), i = 0..300 laid out as [4, 3, 5, 5]; gamma [1.5, 0.5, -1], beta [0.1, -0.2, 0.3].
"""
import numpy as np, mindspore as ms
from mindspore import nn, Tensor, ops, Parameter
ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
n = 4*3*5*5
i = np.arange(n, dtype=np.float64)
x1 = (np.sin(0.37*i)*2 + 0.5).astype(np.float32).reshape(4,3,5,5)
x2 = (np.cos(0.21*i)*1.5 - 0.25).astype(np.float32).reshape(4,3,5,5)
w = (np.sin(0.11*i)).astype(np.float32).reshape(4,3,5,5)   # cotangent weights
bn = nn.BatchNorm2d(3, eps=1e-5, momentum=0.9)
bn.gamma.set_data(Tensor(np.array([1.5,0.5,-1.0],np.float32)))
bn.beta.set_data(Tensor(np.array([0.1,-0.2,0.3],np.float32)))
bn.set_train(True)
y1 = bn(Tensor(x1)).asnumpy()
print("y1[:6]", repr(y1.reshape(-1)[:6].tolist()))
print("y1 wsum", float((y1.astype(np.float64)*w).sum()))
y2 = bn(Tensor(x2)).asnumpy()
print("mm", repr(bn.moving_mean.asnumpy().tolist()))
print("mv", repr(bn.moving_variance.asnumpy().tolist()))
bn.set_train(False)
y3 = bn(Tensor(x1)).asnumpy()
print("eval wsum", float((y3.astype(np.float64)*w).sum()), "y3[:4]", repr(y3.reshape(-1)[:4].tolist()))
# gradients in train mode (fresh BN so moving stats don't matter)
bn2 = nn.BatchNorm2d(3)
bn2.gamma.set_data(Tensor(np.array([1.5,0.5,-1.0],np.float32)))
bn2.beta.set_data(Tensor(np.array([0.1,-0.2,0.3],np.float32)))
bn2.set_train(True)
wt = Tensor(w)
def loss(x):
    return ops.sum(bn2(x) * wt)
gf = ms.grad(loss, grad_position=0, weights=bn2.trainable_params())
gx, (gg, gb) = gf(Tensor(x1))
gx = gx.asnumpy()
print("gx[:6]", repr(gx.reshape(-1)[:6].tolist()))
print("gx wsum", float((gx.astype(np.float64)*w).sum()))
print("dgamma", repr(gg.asnumpy().tolist()), "dbeta", repr(gb.asnumpy().tolist()))
