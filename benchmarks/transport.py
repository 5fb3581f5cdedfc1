"""Moving block hidden states from a target actor to a drafter actor: which transport is fastest.

Compares, in one run and for payloads the size of real verify steps:
  * ``channel``: this project's feature channel (a gloo process group between the two actors,
    non-blocking send on the target, blocking receive inside the drafter's draft call);
  * ``rdt``: Ray Direct Transport (``@ray.method(tensor_transport="gloo")``), the object ref
    handed from the router to the drafter;
  * ``object_store``: a plain actor result passed on as an argument.
Each figure is the median time from "the target has the tensor" to "the drafter has it", as
the router sees it (one call to each actor per step, as in the serving loop).

    python -m benchmarks.transport [--sizes 64K,1M,16M] [--repeats 20] [--out transport.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import ray
import torch

from actors.collective import FeatureChannel, StoreHost, join_group

SIZES = {"K": 1 << 10, "M": 1 << 20}


def parse_size(text: str) -> int:
    return int(text[:-1]) * SIZES[text[-1].upper()] if text[-1].upper() in SIZES else int(text)


@ray.remote(num_cpus=0.5, enable_tensor_transport=True)
class Producer:
    def __init__(self):
        self.tensor = None
        self.channel = None

    def make(self, numel: int) -> None:
        self.tensor = torch.randn(numel // 4)  # float32

    def open(self):
        self.host = StoreHost(2, 30)
        return self.host.address

    def join(self, address) -> None:
        self.channel = FeatureChannel(join_group(address, 0, 2, "gloo", 30, self.host), torch.float32)

    def send_channel(self) -> None:
        self.channel.send(self.tensor[None, :])

    @ray.method(tensor_transport="gloo")
    def produce_rdt(self) -> torch.Tensor:
        return self.tensor

    def produce(self) -> torch.Tensor:
        return self.tensor


@ray.remote(num_cpus=0.5, enable_tensor_transport=True)
class Consumer:
    def __init__(self):
        self.channel = None

    def join(self, address) -> None:
        self.channel = FeatureChannel(join_group(address, 1, 2, "gloo", 30), torch.float32)

    def recv_channel(self) -> int:
        return self.channel.recv().numel()

    def take(self, tensor: torch.Tensor) -> int:
        return tensor.numel()


def measure(producer, consumer, method: str, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        if method == "channel":
            ray.get([producer.send_channel.remote(), consumer.recv_channel.remote()])
        elif method == "rdt":
            ray.get(consumer.take.remote(producer.produce_rdt.remote()))
        else:
            ray.get(consumer.take.remote(producer.produce.remote()))
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64K,1M,16M")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    from ray.experimental.collective import create_collective_group

    producer, consumer = Producer.remote(), Consumer.remote()
    address = ray.get(producer.open.remote())
    ray.get([producer.join.remote(address), consumer.join.remote(address)])
    create_collective_group([producer, consumer], backend="torch_gloo")
    rows = []
    print(f"{'payload':>10} {'channel ms':>11} {'rdt ms':>9} {'object store ms':>16}", flush=True)
    for text in args.sizes.split(","):
        size = parse_size(text)
        ray.get(producer.make.remote(size))
        row = {"bytes": size, **{m: 1000 * measure(producer, consumer, m, args.repeats)
                                 for m in ("channel", "rdt", "object_store")}}
        rows.append(row)
        print(f"{text:>10} {row['channel']:11.2f} {row['rdt']:9.2f} {row['object_store']:16.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    ray.shutdown()


if __name__ == "__main__":
    main()
