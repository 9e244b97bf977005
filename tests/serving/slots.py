"""Block and slot allocation for hand-built vLLM batches in the serving tests."""


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
