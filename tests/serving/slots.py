"""Block and slot allocation for hand-built vLLM batches in the serving tests."""

import torch


class PagedSlots:
    """Allocates blocks and slot mappings for sequences the way vLLM does: a sequence takes
    a free block when its next position starts one; ``free`` is popped from the end."""

    def __init__(self, free: list, bs: int):
        self.free, self.bs = free, bs
        self.table: dict[str, list] = {}
        self.lens: dict[str, int] = {}

    def slots(self, seq: str, T: int) -> list:
        """Flat slots ``block * bs + offset`` of ``seq``'s next ``T`` positions."""
        tab = self.table.setdefault(seq, [])
        n0 = self.lens.get(seq, 0)
        out = []
        for p in range(n0, n0 + T):
            if p // self.bs >= len(tab):
                tab.append(self.free.pop())
            out.append(tab[p // self.bs] * self.bs + p % self.bs)
        self.lens[seq] = n0 + T
        return out


class PagedBatches(PagedSlots):
    """:class:`PagedSlots` that also makes each step's tokens and vLLM's common metadata;
    ``rows[seq]`` keeps the K and V rows every sequence wrote (the float64 oracle's input)."""

    def __init__(self, free: list, bs: int, g: torch.Generator, Hq: int, Hkv: int, D: int, dtype=torch.float32):
        PagedSlots.__init__(self, free, bs)
        self.g, self.Hq, self.Hkv, self.D, self.dtype = g, Hq, Hkv, D, dtype
        self.rows: dict[str, tuple] = {}

    def tokens(self, plan):
        """plan: list of (seq, new tokens), decodes first. Returns q ``[N, Hq, D]``, k, v
        ``[N, Hkv, D]``, the slot mapping ``[N]`` and the query offsets (a list)."""
        slots, qsl = [], [0]
        for seq, T in plan:
            slots += self.slots(seq, T)
            qsl.append(qsl[-1] + T)
        N = qsl[-1]
        k, v = (torch.randn(N, self.Hkv, self.D, generator=self.g).to(self.dtype) for _ in range(2))
        for (seq, _), lo, hi in zip(plan, qsl[:-1], qsl[1:]):
            ok, ov = self.rows.get(seq, (k[:0], v[:0]))
            self.rows[seq] = (torch.cat([ok, k[lo:hi]]), torch.cat([ov, v[lo:hi]]))
        q = torch.randn(N, self.Hq, self.D, generator=self.g).to(self.dtype)
        return q, k, v, torch.tensor(slots), qsl

    def common_metadata(self, plan, qsl, slot_mapping):
        """vLLM's ``CommonAttentionMetadata`` of the step (block table 2 entries wider than needed)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        width = max(len(self.table[s]) for s, _ in plan) + 2
        bt = torch.tensor([self.table[s] + [0] * (width - len(self.table[s])) for s, _ in plan], dtype=torch.int32)
        lens = torch.tensor([self.lens[s] for s, _ in plan], dtype=torch.int32)
        qt = torch.tensor(qsl, dtype=torch.int32)
        return CommonAttentionMetadata(query_start_loc=qt, query_start_loc_cpu=qt, seq_lens=lens, num_reqs=len(plan),
                                       num_actual_tokens=qsl[-1], max_query_len=max(T for _, T in plan),
                                       max_seq_len=int(lens.max()), block_table_tensor=bt, slot_mapping=slot_mapping)
