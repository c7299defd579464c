# Everything a fresh clone needs: `make demo`, `make test`, `make bench`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: kernels soak fuzz demo test bench bench-tools bench-scale proto lint clean gpu-wheels gpu-check

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The daemon's one-pass optimizer kernels, compiled into Numba's cache (kernels/__pycache__)
# once per change of their source (seconds each from cold), so that no daemon compiles them.
kernels: $(STAMP)
	$(PY) -m ps_offload.kernels.step_calibration

demo: $(STAMP) kernels
	$(PY) examples/demo.py

# systemd-analyze checks the unit files (tests/ps_daemon/test_systemd_units.py) and fio runs
# in bench-scale's smoke test (tests/bench/test_scale.py); installed from Debian when this user
# may, else those tests skip and say why. The suite runs on one
# pytest worker per core, at most 4 (pytest-xdist; most tests wait on daemons in other
# processes), a test file to a worker so that module fixtures are shared.
test: $(STAMP) kernels
	command -v systemd-analyze >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends systemd) || echo "systemd-analyze not installed"
	command -v fio >/dev/null || (apt-get update -qq && apt-get install -y -qq fio) || echo "fio not installed"
	$(PY) -m pytest -q --numprocesses auto --maxprocesses 4 --dist loadfile

# The benchmarks' peers: fio (NVMe), iperf3 (loopback TCP) and libaio-dev (DeepSpeed's async
# I/O) from Debian when this user may; DeepSpeed, the `bench` extra, into the venv (see
# pyproject.toml), with a check that torch is still the build constraints.txt pins.
# bench/deepspeed_ops.py then compiles DeepSpeed's ops once (minutes on the first run),
# outside every benchmark.
BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet --no-build-isolation -c constraints.txt -e '.[dev,bench]'
	$(PY) -c "import torch; v = torch.__version__.split('+')[0]; assert v == '2.13.0', f'bench extra changed torch to {v}'"
	touch $(BENCH_STAMP)

bench-tools:
	command -v fio >/dev/null || (apt-get update -qq && apt-get install -y -qq fio) || echo "fio not installed"
	command -v iperf3 >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iperf3) || echo "iperf3 not installed"
	test -e /usr/include/libaio.h || (apt-get update -qq && apt-get install -y -qq libaio-dev) || echo "libaio-dev not installed"

bench: bench-tools $(BENCH_STAMP)
	$(PY) -m bench.run_all

# A GPT whose AdamW state is twice this machine's RAM (4.25B parameters here), trained for 3
# steps through one daemon (about 60 GB of disk; it checks first and says what it needs).
# About a quarter of an hour, not part of `make bench`.
bench-scale: $(STAMP) bench-tools
	$(PY) -m bench.scale
	$(PY) -c "from bench.run_all import update_doc; update_doc()"

# The fuzz suite at a large budget (2,000 examples per property, over 14,000 requests; a few
# minutes): tests/integration/test_fuzz.py, which `make test` runs at 60 per property.
fuzz: $(STAMP)
	FUZZ_EXAMPLES=2000 $(PY) -m pytest -q -s -p no:cacheprovider -o timeout=3600 tests/integration/test_fuzz.py

# The daemon under the faults of issue #15, each phase bounded (6-15 minutes here): 100
# deaths mid-commit and at random, the fuzz suite, 1,000 waiting pulls on each transport and
# 3,000 idle connections, a 10 s partition (root only). bench/soak.py; docs/reliability.md quotes
# bench/results/reliability/soak.json. Then health under 64 stalled gRPC clients of each kind,
# with the call bounds and without (bench/stalled_clients.py, a minute: stalled_clients.json).
# Then 300 runs of a replicated model whose holder is killed inside a step, at every point of
# it (bench/replica_kills.py, about 25 minutes: replica_kills.json; `make test` runs 7).
soak: $(STAMP)
	$(PY) -m bench.soak
	$(PY) -m bench.stalled_clients
	$(PY) -m bench.replica_kills

# Regenerates ps_proto/ (installed as ps_offload.proto) from proto/ps.proto; tests/ps_proto
# checks the committed copy is fresh.
proto: $(STAMP)
	rm -rf build/protoc && mkdir -p build/protoc
	$(PY) -m grpc_tools.protoc -Ips_offload/proto=proto --python_out=build/protoc --pyi_out=build/protoc --grpc_python_out=build/protoc proto/ps.proto
	cp build/protoc/ps_offload/proto/ps_pb2.py build/protoc/ps_offload/proto/ps_pb2.pyi build/protoc/ps_offload/proto/ps_pb2_grpc.py ps_proto/

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info

# The GPU machine's one-shot check (docs/gpu.md; bench/gpu_check.py). `make gpu-wheels` here
# (PyPI) fetches into gpu-wheels/ the cp312 x86_64 wheels the GPU image lacks, about 12 MB; the
# device tool then carries that folder and runs `make gpu-check OUT=$OUT` there. gpu-check uses
# the machine's python3 (its CUDA torch) and a venv of its own, never $(VENV), whose recipe
# needs PyPI: on this CPU, `make gpu-check GPU_PY=.venv/bin/python GPU_CHECK_ARGS=--no-install` is a dry run.
OUT            ?= runs/gpu-check
GPU_PY         ?= python3
GPU_CHECK_ARGS ?=

gpu-wheels:
	python3 bench/gpu_check.py wheels --dest gpu-wheels

gpu-check:
	$(GPU_PY) bench/gpu_check.py check --out $(OUT) --wheels gpu-wheels $(GPU_CHECK_ARGS)
