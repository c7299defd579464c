import torch

from ps_offload.daemon.rpc.staging import StagingPool


def test_buffers_are_reused_per_size_and_idle_bytes_are_bounded():
    pool = StagingPool(max_bytes=2 * 4096 * 4)
    with pool.borrow(4096) as a:
        pointer = a.data_ptr()
        assert a.dtype == torch.float32 and a.numel() == 4096
    with pool.borrow(4096) as b:
        assert b.data_ptr() == pointer  # the same memory, no new allocation
        with pool.borrow(4096) as c, pool.borrow(4096) as d:
            assert len({b.data_ptr(), c.data_ptr(), d.data_ptr()}) == 3  # borrowed ones are never shared
    assert pool.idle_bytes == 2 * 4096 * 4  # three returned, two kept
    with pool.borrow(1024) as e:
        assert e.numel() == 1024
    assert pool.idle_bytes == 2 * 4096 * 4  # over the bound: dropped
