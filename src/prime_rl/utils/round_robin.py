"""Smooth weighted round-robin (nginx's): the pick that hits given shares exactly rather than on average. The
orchestrator's server pool spreads requests over servers with it, and batch.EnvMix mixes environments by ratio.
"""


class SmoothRoundRobin:
    """Picks among items with weights w_i so that every prefix of the picks is as close to the shares as
    integers allow: each pick adds w_i to every item's credit and takes the total off the chosen item's."""

    def __init__(self, weights: list[float]):
        if not weights or any(w <= 0 for w in weights):
            raise ValueError(f"weights must be positive, got {weights}")
        self.weights = [float(w) for w in weights]
        self.credit = [0.0] * len(weights)

    def pick(self, among: list[int] | None = None) -> int:
        """The next index (of those in `among`, default all)."""
        among = list(range(len(self.weights))) if among is None else among
        for i in among:
            self.credit[i] += self.weights[i]
        chosen = max(among, key=lambda i: self.credit[i])
        self.credit[chosen] -= sum(self.weights[i] for i in among)
        return chosen

    def reset(self, i: int) -> None:
        self.credit[i] = 0.0
