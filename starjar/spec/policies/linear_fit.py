"""Online least squares for small latency models (normal equations, solved on demand)."""

from __future__ import annotations


class OnlineLeastSquares:
    def __init__(self, n: int, ridge: float = 1e-9):
        self.n = n
        self.xtx = [[ridge if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.xty = [0.0] * n

    def add(self, x: list[float], y: float) -> None:
        for i in range(self.n):
            self.xty[i] += x[i] * y
            for j in range(self.n):
                self.xtx[i][j] += x[i] * x[j]

    def solve(self) -> list[float] | None:
        """Coefficients, or None while the system is singular (Gaussian elimination with pivoting)."""
        n = self.n
        m = [row[:] + [self.xty[i]] for i, row in enumerate(self.xtx)]
        for col in range(n):
            piv = max(range(col, n), key=lambda r: abs(m[r][col]))
            if abs(m[piv][col]) < 1e-12:
                return None
            m[col], m[piv] = m[piv], m[col]
            for r in range(n):
                if r != col:
                    f = m[r][col] / m[col][col]
                    for k in range(col, n + 1):
                        m[r][k] -= f * m[col][k]
        return [m[i][n] / m[i][i] for i in range(n)]
