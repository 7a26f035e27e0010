"""What a ZeroEngine holds and sends: ``memory_report`` (model-state bytes by category, and
the engine's memory at its peak) and ``comm_report`` (bytes per collective kind)."""
from __future__ import annotations

from ..ops import host_pool
from .offload.host_memory import heap_free_bytes


class EngineReports:
    """Mixed into ZeroEngine; reads its flat groups, reducer, fetcher, optimizer, offload,
    swaps, checkpoint saver and process groups."""

    def memory_report(self, reset_peak: bool = False) -> dict[str, int]:
        """Bytes this rank holds for model states, by category: ``params``, ``grads`` and
        ``optimizer_states`` on the training device now, ``host_*`` the same offloaded to host
        memory (on a CPU-only machine both are RAM; the split says where the engine put them),
        ``total`` all of them; with NVMe offload ``nvme_optimizer_states`` and
        ``nvme_params``, the bytes of the master and state, and of the parameter shard, kept on
        the drive (not in the total).

        Where the peak is (since the engine was built, or the last ``reset_peak=True``):
        ``gathered_params_peak`` - stage 3's most bytes of gathered segments at once (the
        module running, prefetched ones, ones kept for backward), ``grad_buckets_peak`` - the
        most bytes of gradient staging and reduce outputs in flight (stages 2-3),
        ``peak_total`` - the states held permanently plus both peaks: the engine's own
        memory at its peak (activations and autograd's temporaries are the model's). And
        ``heap_free``: bytes the C allocator holds free (glibc; resident or not), the slack
        the process can see - see zero_optimization.return_free_host_memory;
        ``host_pool_cached``: free blocks the host pool keeps mapped for the next gather or
        gradient bucket (resident; never more than its own peak of live bytes, ops/host_pool).
        ``checkpoint_staging``: the host buffers asynchronous saves copy the states into
        (kept from one save to the next; not in the totals)."""
        managed = {id(p) for p in self._managed_params()}
        params = sum(fg.nbytes() for fg in self.flat_groups)
        params += sum(p.numel() * p.element_size() for p in self.module.parameters()
                      if id(p) not in managed)
        gathered = gathered_peak = 0
        if self.fetcher is not None:
            params += self.fetcher.secondary_nbytes()
            gathered = self.fetcher.gathered_nbytes()
            gathered_peak = self.fetcher.peak_gathered_bytes
        grads = self.reducer.nbytes()
        staging = self.reducer.staging_nbytes()
        states = sum(fg.master_nbytes() for fg in self.flat_groups)
        host_states = sum(fg.master_nbytes(host=True) for fg in self.flat_groups)
        if self.offload is not None:
            host_states += self.optimizer.state_nbytes()
        else:
            states += self.optimizer.state_nbytes()
        swap = self.optimizer.swap
        if swap is not None:
            host_states += swap.host_bytes()  # the tiles' slots
        host_params = sum(fg.nbytes(host=True) for fg in self.flat_groups)
        if self.param_swap is not None:
            host_params += self.param_swap.host_bytes()  # its cache and reads in flight
        report = {"params": params + gathered, "grads": grads, "optimizer_states": states,
                  "host_params": host_params,
                  "host_grads": self.offload.nbytes() if self.offload is not None else 0,
                  "host_optimizer_states": host_states}
        report["total"] = sum(report.values())
        report["gathered_params_peak"] = gathered_peak
        report["grad_buckets_peak"] = self.reducer.peak_staging_bytes
        report["peak_total"] = report["total"] - gathered - staging + gathered_peak + \
            self.reducer.peak_staging_bytes
        report["heap_free"] = heap_free_bytes()
        report["host_pool_cached"] = host_pool.stats()["cached_bytes"]
        report["checkpoint_staging"] = self.checkpoints.staging_nbytes()
        if swap is not None:  # on the drive, not in memory: outside the total
            report["nvme_optimizer_states"] = swap.file_bytes()
        if self.param_swap is not None:
            report["nvme_params"] = self.param_swap.file_bytes()
        if reset_peak:
            self.reducer.reset_peak()
            if self.fetcher is not None:
                self.fetcher.reset_peak()
        return report

    def comm_report(self, reset: bool = True) -> dict[str, dict[str, int]]:
        """Bytes this rank sent/received per collective kind since the last call. Hybrid
        sharding: kinds inside the shard group are named as in a plain run, the all-reduce
        across groups ``all_reduce@replica_group`` (the traffic that crosses nodes)."""
        out = self.comm.report(reset)
        for name, comm in self.topology.comms().items():
            if name == "world":
                continue
            for kind, counts in comm.report(reset).items():
                key = kind if name == "shard_group" else f"{kind}@{name}"
                if key in out:
                    out[key] = {k: out[key][k] + v for k, v in counts.items()}
                else:
                    out[key] = counts
        return out
