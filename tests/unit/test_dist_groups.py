"""``Dist.own_group``: two real processes in a gloo process group (as two ranks are), each running
collectives from two threads at once, the main thread's over the default group (the update's) and a
background thread's over its own group (an overlapped rollout's dynamic sampling): every result is right
and none waits on the other's. Without a group of its own the two threads' collectives would meet in one
group in no agreed order."""

import threading

import pytest
import torch.multiprocessing as mp

ROUNDS = 50


def _rank(rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    from rlctl.engine.dist import Dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)  # the parent's server (bound once)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    main = Dist(torch.device("cpu"))
    background = main.own_group()
    sums: list[int] = []

    def generate() -> None:
        for i in range(ROUNDS):
            sums.append(background.sum(i + rank))  # the rounds of one batch: (i) + (i + 1)
        sums.append(int(background.all(rank == 0)))  # 0: not every rank says so

    thread = threading.Thread(target=generate)
    thread.start()
    updates = [main.max(i * (rank + 1)) for i in range(ROUNDS)]  # the update's, meanwhile: 2i
    thread.join(timeout=60)
    out.put((rank, sums, updates, thread.is_alive(), background.world, main.all(True)))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_group_of_its_own_keeps_a_threads_collectives_apart():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    from rlctl.engine.rendezvous import bind_rendezvous

    server = bind_rendezvous(2)  # the ranks' store, bound once on a port the system chose, as rlctl's supervisor does
    procs = [ctx.Process(target=_rank, args=(r, server.port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for rank, sums, updates, hung, world, agreed in results:
        assert not hung and world == 2 and agreed
        assert sums == [2 * i + 1 for i in range(ROUNDS)] + [0], rank
        assert updates == [2 * i for i in range(ROUNDS)], rank


def test_in_a_world_of_one_its_own_group_is_itself():
    import torch

    from rlctl.engine.dist import Dist

    one = Dist(torch.device("cpu"))
    assert not one.active and one.own_group() is one
