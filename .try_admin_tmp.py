import subprocess, sys, tempfile, pathlib, time
sys.path.insert(0, "tests")
from conftest import start_daemon
import torch, trainer
d = start_daemon(pathlib.Path(tempfile.mkdtemp()))
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.Linear(50, 3))
with trainer.offload(m, daemons=[d.address], optimizer=trainer.SGD(lr=0.1), shard_bytes=4096) as opt:
    for _ in range(3):
        opt.zero_grad(); m(torch.randn(4, 40)).sum().backward(); opt.step()
    opt.synchronize()
    def run(*a):
        t=time.time(); r = subprocess.run([sys.executable, "-m", "ps_daemon.admin", *a], capture_output=True, text=True)
        print("$", " ".join(a), "->", r.returncode, f"{time.time()-t:.2f}s"); print(r.stdout); print("ERR:", r.stderr)
    run("shards", "--daemon", d.address)
    run("shards", "--daemon", d.address, "--daemon", "127.0.0.1:1")
    run("shard", "1", "--daemon", d.address)
    run("shard", "1", "--daemon", d.address, "--json")
    run("shard", "99", "--daemon", d.address)
    run("shard", "0", "--daemon", d.address, "--model", "nope")
    run("stats", "--daemon", d.address)
    run("stats", "--daemon", d.address, "--json")
    run("stats", "--daemon", "127.0.0.1:1", "--json")
    run("shard", "-1", "--daemon", d.address)
d.stop()
