"""Is a stage's model work slower inside its Triton stub than in one process, or is it slower because the work
hops between processes? The served benchmark finds the decoder's compute in its stub 1.2-1.6 ms above the same
decode in-process, where the in-process request runs encoder, decoder and ranker back to back in one process.
Here one decode of a real ML-1M user's history goes, in every repetition:
  1. to the served `pfa_decoder` directly over gRPC (its compute_infer from Triton's statistics: the decode,
     reading the request and building the response);
  2. in this process right after that request returned (the caches as another process left them);
  3. in this process once more, right after 2 (back to back, the caches this process left);
  4. to the floor's no-op `pfa_decoder` (perf/floor: the same config and contract, a stage that returns
     tensors of the real sizes): what Triton and the Python stub cost a call, without the work.
Same weights, states, options and torch threads; the outputs are checked equal. Paired per repetition, so the
host's drift cancels in the ratios. Run from the repository root (needs the benchmark model, `make bench-served`
trains it):
    python -m perf.experiments.stub_vs_in_process      # -> perf/results/stub_vs_in_process.json
    python -m perf.experiments.stub_vs_in_process --quick --out -
"""
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from genrec_contract import protocol as P
from perf.common import host_load, log, save_result
from perf.experiments import bench_model_parser


def main(argv=None):
    ap = bench_model_parser(__doc__, "stub_vs_in_process.json")
    ap.add_argument("--histories", type=int, nargs="+", default=[50, 512])
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args(argv)
    import tritonclient.grpc as grpcclient

    from backend_src.config import DecodeOptions
    from backend_src.data import load_dataset
    from backend_src.decoding.cuda_graphs import DecodeGraphs
    from backend_src.model.recommender import GenerativeRecommender
    from export.triton_configs import ServingOptions
    from perf.served import compute_infer_ns, long_history, same_runtime_as_the_server
    from perf.floor import floor_server
    from perf.served_eval import local_server

    same_runtime_as_the_server(None, module="perf.experiments.stub_vs_in_process")
    torch.set_num_threads(1)  # as each served stage runs
    reps = 10 if args.quick else args.reps
    load_start = host_load()
    model = GenerativeRecommender.load(args.checkpoint)
    data = load_dataset(args.data, max_users=args.max_users)
    decode = DecodeOptions(mode="pfa", beam_width=100, k=256, r=0.5, selection_step=1)
    graphs = DecodeGraphs(model, max_history=model.cfg.max_seq_len)  # the decoder stage's own decode
    serving = ServingOptions(decode=decode, top_k=10, torch_threads=1, visit_idle_s=120)
    rows = []
    with local_server(args.checkpoint, serving) as server, floor_server(model.cfg, serving) as floor:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        floor_client = grpcclient.InferenceServerClient(floor.grpc_url)
        for n in sorted({min(h, model.cfg.max_seq_len) for h in args.histories}):
            items, actions, ts = long_history(data, n)
            with torch.inference_mode():
                cache = model.encode(torch.as_tensor(model.item_indices(items))[None], torch.tensor([actions]),
                                     torch.tensor([ts]), torch.tensor([n]))
            states = cache.states[:, :n].contiguous()
            lengths = torch.tensor([n])
            inp = grpcclient.InferInput(P.HISTORY_STATES.name, list(states.shape), "FP32")
            inp.set_data_from_numpy(states.numpy())

            def local():
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    beams = graphs.retrieve(states, lengths, decode)
                    items_out = beams.item_ids.numpy()
                    return (time.perf_counter() - t0) * 1e3, items_out

            served_items = client.infer(P.DECODER, [inp]).as_numpy(P.CANDIDATE_ITEMS.name)
            if not np.array_equal(served_items, local()[1]):
                raise SystemExit(f"history {n}: the served decode's candidates differ from the in-process ones")
            stub, after_switch, back_to_back, noop = [], [], [], []
            for i in range(reps + 5):
                before = compute_infer_ns(client, P.DECODER)
                client.infer(P.DECODER, [inp])
                infer_ms = (compute_infer_ns(client, P.DECODER) - before) / 1e6
                switched, _ = local()
                warm, _ = local()
                before = compute_infer_ns(floor_client, P.DECODER)
                floor_client.infer(P.DECODER, [inp])
                noop_ms = (compute_infer_ns(floor_client, P.DECODER) - before) / 1e6
                if i >= 5:  # warm-up
                    noop.append(noop_ms)
                    stub.append(infer_ms)
                    after_switch.append(switched)
                    back_to_back.append(warm)
            med = statistics.median
            row = dict(history=n, reps=reps, stub_compute_p50_ms=med(stub), in_process_after_switch_p50_ms=med(after_switch),
                       in_process_back_to_back_p50_ms=med(back_to_back), floor_compute_p50_ms=med(noop),
                       stub_minus_after_switch_minus_floor_p50_ms=med([a - b - c for a, b, c in zip(stub, after_switch, noop)]),
                       stub_over_after_switch_p50=med([a / b for a, b in zip(stub, after_switch)]),
                       stub_over_back_to_back_p50=med([a / b for a, b in zip(stub, back_to_back)]),
                       after_switch_over_back_to_back_p50=med([a / b for a, b in zip(after_switch, back_to_back)]))
            rows.append(row)
            log(f"history {n}: stub compute {row['stub_compute_p50_ms']:.2f} ms, in-process after a switch "
                f"{row['in_process_after_switch_p50_ms']:.2f} ms, back to back {row['in_process_back_to_back_p50_ms']:.2f} ms, "
                f"no-op stage {row['floor_compute_p50_ms']:.2f} ms "
                f"(paired: stub - after switch - no-op {row['stub_minus_after_switch_minus_floor_p50_ms']:.2f} ms; "
                f"stub / after switch {row['stub_over_after_switch_p50']:.2f}, "
                f"after switch / back to back {row['after_switch_over_back_to_back_p50']:.2f})")
    if args.out != "-":
        save_result(Path(args.out), rows, "perf.experiments.stub_vs_in_process", argv, load_start,
                    checkpoint=str(args.checkpoint), data=args.data, options=dict(mode="pfa", beam_width=100, k=256))


if __name__ == "__main__":
    main()
