"""Where images are decoded: config.data.decoder -> the host or the GPU.

- choice.py: config.data.decoder ("host", "gpu", "auto") -> a batch
  decoder, or None (decode on the host), and the settings' checks;
- host.py: one image on the host: the JPEG check, the decode, the resize
  and crop (what "host" runs in the reader threads or worker processes,
  and what the GPU decoder falls back to);
- gpu.py: nvImageCodec on the device, one decoder per local GPU.

With "host" every example is decoded where it is read (the pipeline's
``Compact`` calls ``host.decode_host``) and no batch decoder runs. A batch
decoder meets the batch contract that the batch path (train/data/batching.py)
runs: ``decode(encoded, wheres, size)`` -> (uint8 [k, size, size, 3] of the
k members that decode, in order; bool [n]: which did; [(i, where, reason)]
for the others), ``for_device(device)``: the decoder of one local device's
shard, and ``describe()``: one line for the log. The decoders import neither
each other's module nor the pipeline (the GPU decoder uses host.py, below
both); tests/host_decoder.py meets the contract on the host, for tests.
"""
