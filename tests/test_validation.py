"""Argument validation that needs no GPU: tensors on the wrong device, wrong dtype/rank/layout, calls before init."""
import pytest
import torch

import flux_shmem
from flux_shmem.ops._validate import check_dtype, check_tensor, positive


def test_import_is_light_and_lazy():
    assert "init" in flux_shmem.__all__
    with pytest.raises(AttributeError):
        flux_shmem.nonexistent


def test_calls_before_init_name_the_fix():
    for make in (lambda: flux_shmem.AllGather(8, 8), lambda: flux_shmem.ReduceScatter(8, 8),
                 lambda: flux_shmem.empty((4,)), lambda: flux_shmem.barrier()):
        with pytest.raises(flux_shmem.NotInitializedError, match=r"call flux_shmem.init\(\) first"):
            make()


def test_check_tensor_messages():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cuda:0"):
        check_tensor("x", x, dtype=torch.bfloat16, device=0)
    with pytest.raises(TypeError, match="torch.Tensor"):
        check_tensor("x", [1, 2], dtype=torch.bfloat16, device=0)
    with pytest.raises(TypeError, match="not supported"):
        check_dtype("op", torch.int32)
    with pytest.raises(ValueError, match="positive"):
        positive("max_rows", 0)
    with pytest.raises(ValueError, match="positive"):
        positive("max_rows", 2.5)


def test_unknown_ag_engine_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match=r"engine must be one of \('auto', 'sm', 'ce'\)"):
        flux_shmem.AllGatherGEMM(1024, 256, 256, engine="dma")
