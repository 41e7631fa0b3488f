"""The real-client test (issue 14): a plain-torch Llama trained by 2 processes with
Megatron-style TP=2 over torch.distributed (gloo), synced after every optimizer step to
inference processes whose weights live in a vLLM-style nn.Module, recorded from that
module's own load_weights with ferry.record_load.

Processes (each started here with subprocess and env vars; RANK / WORLD_SIZE are how a
launcher would say it):
  * 2 trainers (tests/python/llama_megatron.py): ferry.megatron.MegatronSource over the
    Megatron-Core tensors themselves — materialize returns views of the fused
    linear_qkv / linear_fc1 and of the padded vocab shards — served in place;
  * inference layout tp=2: one process, its 2 ranks as threads (vLLM's tp_forward needs
    both shards to give logits);
  * inference layout tp=1 x 2 replicas: 2 processes.
All 4 inference ranks are consumers of one job (ranks 0-1: tp=2, ranks 2-3: tp=1; the
two tp=1 ranks have equal plans, so they share producers as replicas do).

After every sync each inference process checks that its params are bit-identical to its
module's own load_weights on the HF state dict the trainers gathered for the check, and
that its logits on a fixed batch equal the trainer's within fp32 reduction-order noise.

    test_real_client.py -v                     # the test
    test_real_client.py --trainer DIR          # a trainer process (RANK, WORLD_SIZE, ...)
    test_real_client.py --inference DIR TP RANK...   # an inference process
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_engine import run_threads  # noqa: E402 - each callable on its own thread, first error raised

STEPS = 3
TP_TRAIN = 2
UCX = {"tls": "tcp,self", "net_devices": "lo"}
# fp32 logits through differently ordered reductions (TP partial sums, fused vs split
# matmuls): differences of a few ulps of the largest logits.
LOGITS_ATOL = 1e-4
INFERENCE = [(2, [0, 1]), (1, [2]), (1, [3])]  # (tp, consumer ranks) per inference process
NUM_CONSUMERS = 4


def batch():
    import torch
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 1000, (2, 12), generator=g)


def _wait_go():
    print(json.dumps({"ready": True}), flush=True)
    line = sys.stdin.readline()
    if line.strip() != "go":
        raise SystemExit(f"expected 'go', got {line!r}")


# --- trainer ---------------------------------------------------------------------------

def trainer_main(workdir):
    import torch
    import torch.distributed as dist
    import ferry
    from llama_megatron import MegatronLlama
    from llama_vllm import TEST_CONFIG, random_hf_state

    torch.manual_seed(0)
    dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the env
    rank = dist.get_rank()
    model = MegatronLlama(random_hf_state(TEST_CONFIG, seed=7), TEST_CONFIG, tp=TP_TRAIN, rank=rank)
    native = model.native()
    layout = ferry.megatron.GPTLayout(TEST_CONFIG, tp=TP_TRAIN, make_vocab_size_divisible_by=128)
    source = ferry.megatron.MegatronSource(layout, native)  # rank and world size from RANK / WORLD_SIZE
    assert (source.rank, source.world_size) == (rank, TP_TRAIN)
    # What materialize returns are views of the trainer's own parameters.
    views = [v for g in range(len(source.groups())) for vs in source.materialize(g).values()
             for v in (vs if isinstance(vs, list) else [vs])]
    storages = {p.data.storage().data_ptr() for p in native.values()}
    assert all(v.storage().data_ptr() in storages for v in views)
    producer = ferry.Producer(source, os.environ["FERRY_STORE"], token=os.environ["FERRY_TOKEN"],
                              num_consumers=NUM_CONSUMERS, job="real", backend="ucx", transport_params=UCX,
                              in_place=True, direct_min_bytes=0, timeout=60.0, stall_timeout=60.0,
                              # (not a straggler test: in CI's sanitizer pass, beside a build, an
                              # inference process once took over 6 s - the 2 x lease_ttl bound -
                              # to release its first sync's group 1, and both its consumers
                              # were dropped as stragglers)
                              straggler_floor=30.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = batch()
    _wait_go()
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()  # in place: the parameters keep their storage, as in_place promises
        with torch.no_grad():
            after = model(ids)
            hf = model.gather_hf()
        if rank == 0:
            tmp = os.path.join(workdir, f"v{step}.tmp")
            torch.save({"hf": hf, "logits": after}, tmp)
            os.rename(tmp, os.path.join(workdir, f"v{step}.pt"))
        rep = producer.sync(step)
        print(json.dumps({"step": step, "loss": loss.item(), "ok": rep["ok"], "bytes_sent": rep["bytes_sent"],
                          "sent_in_place": rep["sent_in_place"], "text": rep["text"]}), flush=True)
    producer.close()
    dist.destroy_process_group()


# --- inference -------------------------------------------------------------------------

def inference_main(workdir, tp, ranks):
    import time
    import torch
    import ferry
    from llama_vllm import TEST_CONFIG, LlamaForCausalLM, hf_shapes, tp_forward

    metadata = hf_shapes(TEST_CONFIG)
    modules, consumers = [], []
    for i, consumer_rank in enumerate(ranks):
        m = LlamaForCausalLM(TEST_CONFIG, tp_rank=i, tp_size=tp)
        plan = ferry.record_load(m, metadata)  # the module's own load_weights, recorded
        modules.append(m)
        consumers.append((consumer_rank, plan, m))
    made = [None] * len(consumers)

    def create(i):
        r, plan, m = consumers[i]
        made[i] = ferry.Consumer(plan=plan, params=m, rank=r, store=os.environ["FERRY_STORE"],
                                 token=os.environ["FERRY_TOKEN"], num_producers=TP_TRAIN,
                                 num_consumers=NUM_CONSUMERS, job="real", backend="ucx", transport_params=UCX,
                                 timeout=60.0, stall_timeout=60.0)

    run_threads([lambda i=i: create(i) for i in range(len(consumers))])
    ids = batch()
    _wait_go()
    for v in range(1, STEPS + 1):
        reports = run_threads([lambda c=c: c.sync(v) for c in made])
        path = os.path.join(workdir, f"v{v}.pt")
        for _ in range(600):
            if os.path.exists(path):
                break
            time.sleep(0.1)
        ref = torch.load(path)
        mismatched = []
        for i, m in enumerate(modules):
            expected = LlamaForCausalLM(TEST_CONFIG, tp_rank=i, tp_size=tp)
            expected.load_weights(ref["hf"].items())  # the module's own loader on the gathered HF weights
            got = dict(m.named_parameters())
            for name, p in expected.named_parameters():
                if not torch.equal(p.data.view(torch.int32), got[name].data.view(torch.int32)):
                    mismatched.append(f"rank {ranks[i]} {name}")
        logits = tp_forward(modules, ids)
        diff = (logits - ref["logits"]).abs().max().item()
        print(json.dumps({"version": v, "ranks": ranks, "ok": [r["ok"] for r in reports],
                          "bytes": [r["bytes_received"] for r in reports], "mismatched": mismatched,
                          "logits_max_diff": diff}), flush=True)
    for c in made:
        c.close()


# --- the test ----------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RealClientTest(unittest.TestCase):
    def test_megatron_tp2_trainer_to_vllm_style_tp2_and_tp1x2(self):
        import ferry
        with ferry.StoreServer() as server, tempfile.TemporaryDirectory() as workdir:
            base = dict(os.environ, FERRY_STORE=server.url, FERRY_TOKEN=server.token, OMP_NUM_THREADS="1")
            for k in ("RANK", "WORLD_SIZE", "FERRY_RANK", "FERRY_WORLD_SIZE", "LOCAL_RANK"):
                base.pop(k, None)
            port = str(free_port())
            procs = []
            for r in range(TP_TRAIN):
                env = dict(base, RANK=str(r), WORLD_SIZE=str(TP_TRAIN), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                procs.append(("trainer", subprocess.Popen([sys.executable, __file__, "--trainer", workdir], env=env,
                                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)))
            for tp, ranks in INFERENCE:
                procs.append(("inference", subprocess.Popen(
                    [sys.executable, __file__, "--inference", workdir, str(tp)] + [str(r) for r in ranks], env=base,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)))
            killer = threading.Timer(240, lambda: [p.kill() for _, p in procs])  # a bound, not a pass condition
            killer.start()
            try:
                for _, p in procs:  # everyone created: producers and consumers
                    self.assertEqual(json.loads(p.stdout.readline() or "null"), {"ready": True})
                for _, p in procs:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                outputs = [[json.loads(line) for line in p.stdout] for _, p in procs]
                codes = [p.wait() for _, p in procs]
            finally:
                killer.cancel()
                for _, p in procs:
                    if p.poll() is None:
                        p.kill()
                    p.stdin.close()
                    p.stdout.close()
            self.assertEqual(codes, [0] * len(procs), outputs)

            trainers = outputs[:TP_TRAIN]
            for reps in trainers:
                self.assertEqual([r["step"] for r in reps], list(range(1, STEPS + 1)))
                for r in reps:
                    self.assertTrue(r["ok"], r["text"])
                    self.assertGreater(r["bytes_sent"], 0)
                    # Every piece is a contiguous run of a box that is a view of the trainer's
                    # own tensor, and direct_min_bytes=0: everything is served in place.
                    self.assertEqual(r["sent_in_place"], r["bytes_sent"], r["text"])
            losses = [r["loss"] for r in trainers[0]]
            self.assertLess(losses[-1], losses[0], losses)  # real training steps
            self.assertEqual(losses, [r["loss"] for r in trainers[1]])  # the TP ranks agree

            for reps in outputs[TP_TRAIN:]:
                self.assertEqual([r["version"] for r in reps], list(range(1, STEPS + 1)))
                for r in reps:
                    self.assertTrue(all(r["ok"]), r)
                    self.assertTrue(all(b > 0 for b in r["bytes"]), r)
                    self.assertEqual(r["mismatched"], [], r)
                    self.assertLess(r["logits_max_diff"], LOGITS_ATOL, r)
            print("\nlosses:", losses, "; in place:",
                  [f"{r['sent_in_place']}/{r['bytes_sent']}" for r in trainers[0]],
                  "; logits max diff:", max(r["logits_max_diff"] for reps in outputs[TP_TRAIN:] for r in reps),
                  file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--trainer":
        trainer_main(sys.argv[2])
    elif len(sys.argv) >= 5 and sys.argv[1] == "--inference":
        inference_main(sys.argv[2], int(sys.argv[3]), [int(r) for r in sys.argv[4:]])
    else:
        unittest.main()
