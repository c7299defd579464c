"""What more than one test file needs, in one place: test files import from here (or use
conftest.py's fixtures), never from one another; tests/test_test_layout.py holds them to it.
Nothing here is collected (no test_ functions).

  admin_cli        `ps-admin` run as a subprocess, its --json read back, verify's verdicts
  data_plane       a model registered over gRPC, with a TCP data-plane client to it
  fuzz_inputs      Hypothesis strategies: any message of proto/ps.proto, hostile numbers and names
  group_commit     one model's NVMe files committed shard by shard, one byte value per version, and
                   what recovery finds of them
  group_model      the odd-shaped model in three param groups whose settings change each step,
                   its spec, gradients and fused torch.optim twin
  kernel_cases     the checks every backend of kernels/ must pass against the torch reference
  metrics          a daemon serving Prometheus metrics, and its samples scraped
  site_first       installed packages before the repository's folders on sys.path (PyPI's kernels
                   for transformers, not kernels/)
  mixed_precision  bf16/fp16 MLP training: the fp32-master reference and the bit-for-bit check
  nvme_files       a daemon's NVMe files from outside: committed slots, flipped bytes, format 2
  odd_shapes       the model whose shard cuts fall at odd offsets inside parameters
  payloads         tensors as push bytes, and the compressed encodings' payloads
  persistence_run  the 24-step MLP run durability tests train through dying daemons
  pipeline_mlp     the pp x dp run: layers, batches, loss, its shape, and torchrun() of its worker
  replication      replicated models over NVMe daemons, one lost for good, `ps-admin replicas`
  rounding_edges   fp32 values at the edges of bf16 and fp16 rounding
  snapshots        the MLP run snapshot tests cut at step CUT, and its resumption check
  specs            one-parameter SGD and AdamW model specs with known plans; one registered in a
                   ShardStore directly
  streamed_gpt     the tiny GPT streamed through daemons, and its in-process twin
  training         MLP and GPT cases, the in-process and offloaded loops, the no-decay rule
  waiting          polling a predicate or a daemon's Stats until it holds, at most 60 s
"""
