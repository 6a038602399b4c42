"""A planted class for the similarity check: six independent DynamicScaler solutions and one copy of "ana"
with every name she chose renamed, comments added and the layout reformatted (tests/test_class_grading.py)."""

STARTER = '''import torch


class DynamicScaler:
    """Loss scaling with backoff and growth, like torch.amp.GradScaler."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        # YOUR CODE HERE
        raise NotImplementedError()

    def scale(self, loss):
        # YOUR CODE HERE
        raise NotImplementedError()

    def step(self, optimizer, params):
        # YOUR CODE HERE
        raise NotImplementedError()
'''

SOLUTIONS = {
"ana": '''import torch


class DynamicScaler:
    """Loss scaling with backoff and growth, like torch.amp.GradScaler."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0

    def scale(self, loss):
        return loss * self.scale_value

    def step(self, optimizer, params):
        grads = [p.grad for p in params if p.grad is not None]
        inv = 1.0 / self.scale_value
        found_inf = False
        for g in grads:
            g.mul_(inv)
            if not torch.isfinite(g).all():
                found_inf = True
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
            optimizer.zero_grad()
            return False
        optimizer.step()
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale_value *= self.growth_factor
            self.good_steps = 0
        return True
''',
"ben": '''import math
import torch


class DynamicScaler:
    def __init__(self, init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self._s = init_scale
        self._up, self._down, self._every = growth_factor, backoff_factor, growth_interval
        self._streak = 0

    def scale(self, loss):
        return loss * self._s

    def _unscale(self, params):
        ok = True
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    continue
                p.grad.div_(self._s)
                ok = ok and bool(torch.isfinite(p.grad).all())
        return ok

    def step(self, optimizer, params):
        params = list(params)
        if not self._unscale(params):
            self._s = self._s * self._down
            self._streak = 0
            for p in params:
                p.grad = None
            return False
        optimizer.step()
        self._streak = (self._streak + 1) % self._every
        if self._streak == 0:
            self._s = self._s * self._up
        return True
''',
"chen": '''import torch

class DynamicScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.state = {"scale": torch.tensor(init_scale), "growth": 0}
        self.cfg = dict(up=growth_factor, down=backoff_factor, interval=growth_interval)

    def scale(self, loss):
        return loss * self.state["scale"].to(loss.device)

    def step(self, optimizer, params):
        grads = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
        s = self.state["scale"].item()
        finite = torch.isfinite(grads).all().item()
        if finite:
            for p in params:
                if p.grad is not None:
                    p.grad /= s
            optimizer.step()
            self.state["growth"] += 1
            if self.state["growth"] >= self.cfg["interval"]:
                self.state["scale"] *= self.cfg["up"]
                self.state["growth"] = 0
        else:
            self.state["scale"] *= self.cfg["down"]
            self.state["growth"] = 0
        optimizer.zero_grad(set_to_none=True)
        return bool(finite)
''',
"dev": '''import torch


class DynamicScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.current = init_scale
        self.factors = (growth_factor, backoff_factor)
        self.interval = growth_interval
        self.since_backoff = 0
        self.history = []

    def scale(self, loss):
        return self.current * loss

    def has_overflow(self, params):
        total = sum(float(p.grad.float().abs().sum()) for p in params if p.grad is not None)
        return total != total or total == float("inf")

    def step(self, optimizer, params):
        params = [p for p in params]
        overflow = self.has_overflow(params)
        self.history.append(self.current)
        if overflow:
            self.current = self.current * self.factors[1]
            self.since_backoff = 0
        else:
            for p in params:
                if p.grad is not None:
                    p.grad.data = p.grad.data / self.current
            optimizer.step()
            self.since_backoff += 1
            if self.since_backoff % self.interval == 0:
                self.current = self.current * self.factors[0]
        for p in params:
            p.grad = None
        return not overflow
''',
"eve": '''import torch


class DynamicScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.s = init_scale
        self.g = growth_factor
        self.b = backoff_factor
        self.n = growth_interval
        self.count = 0

    def scale(self, loss):
        return loss.mul(self.s)

    def step(self, optimizer, params):
        norms = torch.stack([torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None])
        if not bool(torch.isfinite(norms).all()):
            self.s, self.count = self.s * self.b, 0
            optimizer.zero_grad()
            return False
        torch._foreach_div_([p.grad for p in params if p.grad is not None], self.s)
        optimizer.step()
        optimizer.zero_grad()
        self.count = self.count + 1
        if self.count >= self.n:
            self.s, self.count = self.s * self.g, 0
        return True
''',
"fay": '''import torch


def _finite(tensors):
    for t in tensors:
        if torch.isnan(t).any() or torch.isinf(t).any():
            return False
    return True


class DynamicScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.value = init_scale
        self.grow_by = growth_factor
        self.shrink_by = backoff_factor
        self.patience = growth_interval
        self.clean = 0

    def scale(self, loss):
        out = loss * self.value
        return out

    def step(self, optimizer, params):
        with_grad = [p for p in params if p.grad is not None]
        if _finite([p.grad for p in with_grad]):
            for p in with_grad:
                p.grad.mul_(1.0 / self.value)
            optimizer.step()
            self.clean += 1
            stepped = True
        else:
            self.value *= self.shrink_by
            self.clean = 0
            stepped = False
        if self.clean and self.clean % self.patience == 0:
            self.value *= self.grow_by
        optimizer.zero_grad()
        return stepped
''',
}

# ana's solution, every name of hers renamed, comments added, reformatted (one-liners split, blank lines moved).
COPY = '''import torch


class DynamicScaler:
    """My loss scaler."""

    def __init__(
        self,
        init_scale=2.0 ** 16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
    ):
        # remember the settings
        self.cur = float(init_scale)
        self.grow = growth_factor
        self.shrink = backoff_factor
        self.period = growth_interval
        self.run_length = 0
    def scale(self, loss):
        return loss * self.cur  # scaled loss
    def step(self, optimizer, params):
        gs = [
            q.grad
            for q in params
            if q.grad is not None
        ]
        factor = 1.0 / self.cur

        bad = False
        for t in gs:
            t.mul_(factor)
            if not torch.isfinite(t).all():
                bad = True
        if bad:
            self.cur *= self.shrink
            self.run_length = 0
            optimizer.zero_grad()
            return False

        optimizer.step()
        self.run_length += 1
        if self.run_length == self.period:
            self.cur *= self.grow
            self.run_length = 0
        return True
'''
