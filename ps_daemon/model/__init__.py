"""What a model is to a daemon, and the math it runs: the spec RegisterModel declares and its
validation (spec), the optimizers equal to torch.optim (optimizer), the push encodings'
sizes and parsing (encodings), and the testing aid that perturbs an update on purpose
(faults). Pure domain: no files, no locks across shards, no transport. Imports the
contract (ps_offload.proto), the kernels and ps_offload.daemon.errors only.
"""
