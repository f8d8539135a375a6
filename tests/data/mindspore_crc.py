# Writes mindspore_crc.ckpt (the reference for tests/it/model.rs) with MindSpore 2.10 itself:
# pip install mindspore==2.10.0 in a throwaway venv, then run this in tests/data/.
import binascii, os, numpy as np, mindspore as ms
from mindspore import Tensor
from mindspore.train.checkpoint_pb2 import Checkpoint
params = [
    {"name": "a", "data": Tensor(np.array([[1.5, -2.0, 3.25], [0.0, 1e-3, 7.0]], dtype=np.float32))},
    {"name": "b", "data": Tensor(np.array([1, 2, 3], dtype=np.int32))},
    {"name": "c", "data": Tensor(np.array(0.5, dtype=np.float32))},
]
for fn, crc in (("crc.ckpt", True), ("nocrc.ckpt", False)):
    if os.path.exists(fn):
        os.chmod(fn, 0o600); os.remove(fn)
    ms.save_checkpoint(params, fn, crc_check=crc)
    print(fn, os.path.getsize(fn), oct(os.stat(fn).st_mode))
raw = open("crc.ckpt", "rb").read()
body, trailer = raw[:-17], raw[-17:]
print("trailer", trailer)
print("stored crc", int.from_bytes(trailer[7:], "big"), "calc", binascii.crc32(body))
assert body == open("nocrc.ckpt", "rb").read()
# per-message boundaries: parse each message separately by re-serializing
cp = Checkpoint(); cp.ParseFromString(body)
off = 0; acc = 0
for v in cp.value:
    m = Checkpoint(); m.value.add().CopyFrom(v)
    s = m.SerializeToString()
    assert body[off:off+len(s)] == s
    acc = binascii.crc32(s, acc)
    print("msg", v.tag, "offset", off, "len", len(s), "dims", list(v.tensor.dims), "type", v.tensor.tensor_type, "content", v.tensor.tensor_content.hex(), "running crc", acc)
    off += len(s)
print("zlib check", __import__("zlib").crc32(body))
for fn, crc in (("crc.ckpt", True), ("nocrc.ckpt", False)):
    d = ms.load_checkpoint(fn, crc_check=True)
    print(fn, {k: (v.shape, v.dtype, v.asnumpy().tolist()) for k, v in d.items()})
