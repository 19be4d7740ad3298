"""A deterministic synthetic world whose engagement comes from hidden ground truth.

The world stands in for the upstream logs of docs/architecture.md §2 (``raw/events``, ``raw/pins``, ``raw/users``) and the
daily human review of a sample of pins (``raw/pin_labels``: a policy label and a topic, for the content model),
and adds the hidden truth (``truth`` per impression, ``truth_pins`` per pin) that evaluation uses for the oracle
figures. No model reads it. A pin's content (its topic, hidden unsafety, image embedding and text tokens, see
``_Content``) comes from random streams of its own, so the engagement world is the same with or without it.

The hidden model
----------------
* Categories have centroids in a latent space of dimension 8. A pin's hidden latent vector is its
  category centroid plus noise; its popularity is the quality of its creator plus noise. A user's hidden
  taste is a mix of the centroids of two favourite categories plus noise.
* The visible 32-d ``embedding`` of a pin is a fixed random projection of its latent, plus a fixed vector
  per category, plus noise: informative, not perfect.
* Every user keeps a hidden per-category *recent interest* state ``S``. Each day it decays (x0.5), some
  users get a new passing interest in a random category, and it is boosted by ``1 - 0.5**n`` for a
  category whose pins the user clicked or repinned ``n`` times the day before. It lifts both what the user
  is shown and the click and repin probabilities of that category: it is what a model that reads the
  user's recent action sequence can learn and one that does not cannot. A few unwritten burn-in days run
  before the first day so that the state (and the positive rates) are already settled on day one.
* Each day a user is active with a personal probability (mean ``active_rate``) and gets about
  ``impressions_per_user`` (±25%) impressions in one session. Each impression is drawn either from the
  popularity distribution of the corpus or from the user's interests (a category drawn from taste and
  recent interest, then a pin of that category weighted by popularity). ``pins`` pins exist before the
  first day; each later day adds 1% more at 00:00 UTC, and only pins that exist are shown.
* With ``match = taste·latent / sqrt(8)`` and ``recent = 1 - exp(-S[user, category])``::

      q_click = sigmoid(b_c + user_bias + 1.0 match + 0.8 pop + w recent       + surface_c)
      q_repin = sigmoid(b_r + user_bias + 1.1 match + 0.6 pop + 0.8 w recent)
      p_hide  = sigmoid(b_h - 1.2 match - 0.3 pop - 0.3 w recent)

  with ``w = WorldConfig.recent_weight``. The intercepts ``b_*`` are fitted during the burn-in so that
  the positive rates are about 10% click, 4% repin and 3% hide whatever the size and seed (the truth
  partition's ``_metadata.json`` records them). An impression is hidden with ``p_hide``; a hidden impression
  gets no click nor repin; otherwise click and repin are drawn independently (a repin can happen
  without a click), and a click is followed by a closeup with probability 0.3. The truth file holds the
  marginal probabilities: ``p_click = (1 - p_hide) q_click``, ``p_repin = (1 - p_hide) q_repin``.

Events: ``event_id = days since 1970-01-01 * 10**9 + rank of the event in the day``, so ids are unique
across days and increase with ``ts``. An impression's ``impression_id`` is its own ``event_id``; an
engagement carries its impression's id, user, pin and surface, and comes seconds to minutes later, in the
same UTC day. Ids of users, pins and creators start at 1.

A day's data depends only on the config and the days before it, not on ``days``: generating more days
with the same config leaves the earlier days unchanged. It is not possible to generate a day alone: the
recent-interest state needs the days before it (``generate_world`` always starts at ``start``).

Usage::

    python -m features.synthetic --root .pinflow/storage --start 2026-11-01 --days 10
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from core import contracts, storage

LATENT_DIM = 8
DAY_US = 86_400 * 1_000_000
EVENT_ID_DAY_STRIDE = 10**9
DATASETS: dict[str, pa.Schema] = {
    contracts.RAW_EVENTS: contracts.EVENTS_SCHEMA,
    contracts.RAW_PINS: contracts.PINS_SCHEMA,
    contracts.RAW_USERS: contracts.USERS_SCHEMA,
    contracts.TRUTH: contracts.TRUTH_SCHEMA,
    contracts.RAW_PIN_LABELS: contracts.PIN_LABELS_SCHEMA,
    contracts.TRUTH_PINS: contracts.TRUTH_PINS_SCHEMA,
}
COUNTRIES: tuple[str, ...] = ("US", "BR", "GB", "DE", "FR", "JP", "IN", "CA")
COUNTRY_P = np.array([0.4, 0.12, 0.1, 0.09, 0.08, 0.08, 0.08, 0.05])
SURFACE_P = np.array([0.6, 0.25, 0.15])  # in the order of contracts.SURFACES
SURFACE_CLICK_OFFSET = np.array([0.0, 0.4, 0.2])

# Hidden model constants (see the module docstring). Positive rates (per impression) that the intercepts b_c, b_r, b_h are fitted to during the burn-in.
TARGET_RATES: dict[str, float] = {"click": 0.10, "repin": 0.04, "hide": 0.03}
INTEREST_DECAY = 0.5
SHOCK_RATE = 0.2  # share of users that get a new passing interest each day
POPULAR_SHARE = 0.4  # share of impressions drawn from the global popularity distribution
CLOSEUP_RATE = 0.3
NEW_PIN_RATE = 0.01  # new pins per day after the first, as a share of the initial corpus
EMBEDDING_NOISE = 0.6
BURN_IN_DAYS = 5  # unwritten days that settle the recent-interest state before the first day
# Content of a pin (for the content-understanding family; drawn from streams of their own, so that they leave
# the engagement world unchanged).
TOPIC_OF_CATEGORY_P = 0.7  # a pin's topic is its category's topic with this probability, else any topic
IMAGE_TOPIC_SCALE = 1.6  # norm scale of the topic centroids in the image embedding
IMAGE_UNSAFE_SCALE = 3.0  # how strongly the hidden unsafety shows along one direction of the image embedding
TOKENS_PER_PIN = 10
TOPIC_TOKENS = 16  # tokens [t * 16, (t + 1) * 16) belong to topic t
UNSAFE_TOKENS = 16  # the last tokens of the vocabulary are policy-violating words
UNSAFE_SLOPE = 2.5  # p_unsafe = sigmoid(UNSAFE_SLOPE * z + b), z the pin's hidden unsafety
UNSAFE_RATE = 0.04  # the mean of p_unsafe over the corpus (b is set for it)
REVIEW_AGREEMENT = 0.9  # a reviewer gives the pin's true topic with this probability, else another one

_IMP, _CLICK, _REPIN, _HIDE, _CLOSEUP = (
    contracts.ACTIONS.index(a) for a in ("impression", "click", "repin", "hide", "closeup")
)


@dataclass(frozen=True)
class WorldConfig:
    """The size and seed of a synthetic world.

    ``pins`` is the corpus on the first day (1% more arrive each later day). ``recent_weight`` is the
    weight of the hidden recent-interest term in the click and repin logits (0 turns the effect off; tests
    use it to show that the effect is causal). ``review_rate`` is the share of the corpus that human review
    labels each day (``raw/pin_labels``).
    """

    start: str
    days: int
    users: int = 2000
    pins: int = 3000
    categories: int = 12
    seed: int = 7
    impressions_per_user: int = 20
    active_rate: float = 0.5
    recent_weight: float = 1.5
    review_rate: float = 0.3
    embedding_dim: int = contracts.EMBEDDING_DIM
    # raw/pins after the first day holds only that day's new pins (``"snapshot": "incremental"``), as a source
    # that does not re-snapshot its whole corpus daily would write it.
    incremental_pins: bool = False

    def __post_init__(self) -> None:
        storage.parse_ds(self.start)
        problems = [
            f"{name}={getattr(self, name)} must be >= {low}"
            for name, low in (("days", 1), ("users", 1), ("pins", 1), ("categories", 1), ("impressions_per_user", 1),
                              ("embedding_dim", 1))
            if getattr(self, name) < low
        ]
        if not 0.0 < self.active_rate <= 1.0:
            problems.append(f"active_rate={self.active_rate} must be in (0, 1]")
        if self.recent_weight < 0:
            problems.append(f"recent_weight={self.recent_weight} must be >= 0")
        if not 0.0 < self.review_rate <= 1.0:
            problems.append(f"review_rate={self.review_rate} must be in (0, 1]")
        if problems:
            raise ValueError("invalid synthetic WorldConfig: " + "; ".join(problems))

    @property
    def day_list(self) -> list[str]:
        return [storage.shift_ds(self.start, i) for i in range(self.days)]


@dataclass
class _World:
    """The hidden and visible state of the world; the pin arrays grow as new pins are created."""

    centroids: np.ndarray  # (K, D)
    creator_quality: np.ndarray  # (C,)
    projection: np.ndarray  # (D, embedding_dim)
    category_vec: np.ndarray  # (K, embedding_dim)
    user_taste: np.ndarray  # (U, D)
    user_bias: np.ndarray  # (U,)
    user_active_p: np.ndarray  # (U,)
    user_country: np.ndarray  # (U,) int
    user_created_us: np.ndarray  # (U,) int64
    user_cat_affinity: np.ndarray  # (U, K)
    pin_category: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    pin_creator: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # 0-based
    pin_latent: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, LATENT_DIM)))
    pin_pop: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    pin_embedding: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros((0, contracts.EMBEDDING_DIM), np.float32)
    )
    pin_created_us: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    # Content (see _Content): hidden topic and unsafety, visible image embedding and text tokens.
    content: _Content | None = None

    def add_pins(
        self, rng: np.random.Generator, count: int, created_us: np.ndarray, content_rng: np.random.Generator
    ) -> None:
        """Create ``count`` pins: a category, a creator, a latent near the category, a visible embedding,
        and their content (from ``content_rng``, so that the engagement world does not depend on it)."""
        k, d = self.centroids.shape
        category = rng.integers(0, k, count)
        creator = rng.integers(0, len(self.creator_quality), count)
        latent = 0.8 * self.centroids[category] + rng.normal(0.0, 0.6, (count, d))
        pop = self.creator_quality[creator] + rng.normal(0.0, 0.5, count)
        noise = rng.normal(0.0, EMBEDDING_NOISE, (count, self.projection.shape[1]))
        embedding = (latent @ self.projection + self.category_vec[category] + noise).astype(np.float32)
        self.pin_category = np.concatenate([self.pin_category, category])
        self.pin_creator = np.concatenate([self.pin_creator, creator])
        self.pin_latent = np.concatenate([self.pin_latent, latent])
        self.pin_pop = np.concatenate([self.pin_pop, pop])
        self.pin_embedding = np.concatenate([self.pin_embedding, embedding])
        self.pin_created_us = np.concatenate([self.pin_created_us, created_us.astype(np.int64)])
        assert self.content is not None
        self.content.add(content_rng, category)


@dataclass
class _Content:
    """The content of every pin: a hidden topic and unsafety, and what a model can see of them.

    * topic: the category's topic (``category % TOPICS``) with probability 0.7, else any topic;
    * hidden unsafety ``z ~ N(0, 1)``; ``p_unsafe = sigmoid(2.5 z + b)`` with ``b`` set for a 4% mean: the
      share of reviewers who would call the pin policy-violating (each review draws its own label);
    * ``image_embedding`` (64-d) = the topic's centroid + ``2 z`` along a fixed unit direction + N(0, 1) noise;
    * ``text_tokens``: 10 tokens, each from the topic's 16 tokens (60%) or the shared ones, and each replaced
      by a policy-violating word with probability ``sigmoid(2 z - 4)``.

    A reviewer labels the true topic with probability 0.9, else one of the others uniformly; the truth file
    holds ``p_unsafe`` and that review distribution over topics (the oracle).
    """

    centroids: np.ndarray  # (TOPICS, IMAGE_DIM)
    unsafe_direction: np.ndarray  # (IMAGE_DIM,), unit norm
    bias: float
    topic: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    z: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    image: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, contracts.IMAGE_DIM), np.float32))
    tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, TOKENS_PER_PIN), np.int32))

    @classmethod
    def create(cls, rng: np.random.Generator) -> _Content:
        direction = rng.normal(0.0, 1.0, contracts.IMAGE_DIM)
        centroids = rng.normal(0.0, IMAGE_TOPIC_SCALE / math.sqrt(contracts.IMAGE_DIM) * 4.0,
                               (contracts.TOPICS, contracts.IMAGE_DIM))
        # b such that E[sigmoid(2.5 z + b)] = 4% for z ~ N(0, 1) (probit approximation of the logistic).
        b = math.log(UNSAFE_RATE / (1 - UNSAFE_RATE)) * math.sqrt(1 + math.pi * UNSAFE_SLOPE**2 / 8)
        return cls(centroids=centroids, unsafe_direction=direction / np.linalg.norm(direction), bias=b)

    @property
    def p_unsafe(self) -> np.ndarray:
        return _sigmoid(UNSAFE_SLOPE * self.z + self.bias)

    def add(self, rng: np.random.Generator, category: np.ndarray) -> None:
        n = len(category)
        own = rng.random(n) < TOPIC_OF_CATEGORY_P
        topic = np.where(own, category % contracts.TOPICS, rng.integers(0, contracts.TOPICS, n))
        z = rng.normal(0.0, 1.0, n)
        image = (self.centroids[topic] + IMAGE_UNSAFE_SCALE * z[:, None] * self.unsafe_direction
                 + rng.normal(0.0, 1.0, (n, contracts.IMAGE_DIM))).astype(np.float32)
        shared = contracts.TOPICS * TOPIC_TOKENS
        own_token = topic[:, None] * TOPIC_TOKENS + rng.integers(0, TOPIC_TOKENS, (n, TOKENS_PER_PIN))
        shared_token = shared + rng.integers(0, contracts.TEXT_VOCAB - shared - UNSAFE_TOKENS, (n, TOKENS_PER_PIN))
        tokens = np.where(rng.random((n, TOKENS_PER_PIN)) < 0.6, own_token, shared_token)
        unsafe_word = contracts.TEXT_VOCAB - UNSAFE_TOKENS + rng.integers(0, UNSAFE_TOKENS, (n, TOKENS_PER_PIN))
        swear = rng.random((n, TOKENS_PER_PIN)) < _sigmoid(2.0 * z[:, None] - 4.0)
        tokens = np.where(swear, unsafe_word, tokens).astype(np.int32)
        self.topic = np.concatenate([self.topic, topic])
        self.z = np.concatenate([self.z, z])
        self.image = np.concatenate([self.image, image])
        self.tokens = np.concatenate([self.tokens, tokens])

    def review_probs(self, pins: np.ndarray) -> np.ndarray:
        """The distribution of a reviewer's topic label for each pin: (len(pins), TOPICS)."""
        other = (1.0 - REVIEW_AGREEMENT) / (contracts.TOPICS - 1)
        probs = np.full((len(pins), contracts.TOPICS), other)
        probs[np.arange(len(pins)), self.topic[pins]] = REVIEW_AGREEMENT
        return probs


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _day_start_us(ds: str) -> int:
    return (storage.parse_ds(ds) - dt.date(1970, 1, 1)).days * DAY_US


def _build_world(config: WorldConfig) -> _World:
    """The users and the corpus as of the first day; nothing here depends on ``config.days``."""
    rng = np.random.default_rng(np.random.SeedSequence([config.seed, 0]))
    k, d, n_users = config.categories, LATENT_DIM, config.users
    centroids = rng.normal(0.0, 1.0, (k, d))
    creator_quality = rng.normal(0.0, 0.4, max(1, config.pins // 10))
    projection = rng.normal(0.0, 1.0 / math.sqrt(d), (d, config.embedding_dim))
    category_vec = rng.normal(0.0, 0.5, (k, config.embedding_dim))

    first_day_us = _day_start_us(config.start)
    favourites = np.stack([rng.integers(0, k, n_users), rng.integers(0, k, n_users)], axis=1)
    mix = rng.dirichlet([2.0, 1.0], n_users)
    user_taste = 0.8 * np.einsum("uf,ufd->ud", mix, centroids[favourites]) + rng.normal(0.0, 0.6, (n_users, d))
    if config.active_rate >= 1.0:
        user_active_p = np.ones(n_users)
    else:
        user_active_p = rng.beta(4.0 * config.active_rate, 4.0 * (1.0 - config.active_rate), n_users)
    world = _World(
        centroids=centroids,
        creator_quality=creator_quality,
        projection=projection,
        category_vec=category_vec,
        pin_embedding=np.zeros((0, config.embedding_dim), np.float32),
        user_taste=user_taste,
        user_bias=rng.normal(0.0, 0.3, n_users),
        user_active_p=user_active_p,
        user_country=rng.choice(len(COUNTRIES), n_users, p=COUNTRY_P),
        user_created_us=(first_day_us - rng.integers(1, 3 * 365 * DAY_US, n_users)).astype(np.int64),
        user_cat_affinity=1.5 * (user_taste @ centroids.T) / math.sqrt(d),
    )
    content_rng = np.random.default_rng(np.random.SeedSequence([config.seed, 10]))
    world.content = _Content.create(content_rng)
    # The initial corpus was created during the year before the first day.
    world.add_pins(rng, config.pins, first_day_us - rng.integers(1, 365 * DAY_US, config.pins), content_rng)
    return world


def _sample_rows(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    """One index per row of a (n, k) matrix of row-normalised probabilities."""
    cum = np.cumsum(probs, axis=1)
    u = rng.random(len(probs))[:, None] * cum[:, -1:]
    return np.minimum((cum <= u).sum(axis=1), probs.shape[1] - 1)


def _sample_pins(
    rng: np.random.Generator, world: _World, imp_user: np.ndarray, state: np.ndarray, n_cat: int
) -> np.ndarray:
    """Draw a pin of the current corpus per impression: by popularity, or from one of the user's interests."""
    weight = np.exp(world.pin_pop)
    n = len(imp_user)
    pins = np.empty(n, dtype=np.int64)
    popular = rng.random(n) < POPULAR_SHARE

    cum = np.cumsum(weight)
    n_pop = int(popular.sum())
    pins[popular] = np.searchsorted(cum, rng.random(n_pop) * cum[-1], side="right")

    # Pins sorted by category; key = category + cumulative weight share within the category, so that
    # searchsorted(key, c + u) draws a pin of category c in proportion to its weight.
    order = np.argsort(world.pin_category, kind="stable")
    cat_sorted = world.pin_category[order]
    w_sorted = np.exp(0.5 * world.pin_pop[order])
    cat_total = np.bincount(cat_sorted, weights=w_sorted, minlength=n_cat)
    cum_sorted = np.cumsum(w_sorted)
    before = np.concatenate([[0.0], np.cumsum(cat_total)])[cat_sorted]
    total = cat_total[cat_sorted]
    share = np.divide(cum_sorted - before, total, out=np.zeros_like(cum_sorted), where=total > 0)
    key = cat_sorted + np.clip(share, 0.0, 1.0)
    last_of_cat = np.r_[cat_sorted[1:] != cat_sorted[:-1], True]
    key[last_of_cat] = cat_sorted[last_of_cat] + 1.0

    idx = np.flatnonzero(~popular)
    users = imp_user[idx]
    logits = world.user_cat_affinity[users] + np.log1p(state[users])
    logits = np.where(cat_total > 0, logits, -np.inf)  # a category may have no pins in a tiny world
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    cats = _sample_rows(rng, probs)
    u = np.minimum(rng.random(len(idx)), 1.0 - 1e-9)
    pos = np.minimum(np.searchsorted(key, cats + u, side="right"), len(key) - 1)
    pins[idx] = order[pos]
    return pins


@dataclass
class _Day:
    """The impressions of one day and their engagements, as arrays."""

    user: np.ndarray  # 0-based user index per impression
    pin: np.ndarray  # 0-based pin index per impression
    surface: np.ndarray  # index into contracts.SURFACES
    ts: np.ndarray  # impression time, microseconds since epoch
    p_click: np.ndarray  # marginal true probabilities
    p_repin: np.ndarray
    p_hide: np.ndarray
    labels: dict[int, tuple[np.ndarray, np.ndarray]]  # action -> (impression indices, event ts)


def _fit_intercept(z: np.ndarray, weight: np.ndarray, target: float) -> float:
    """The b with mean(weight * sigmoid(b + z)) == target (Newton's method on a monotone function)."""
    b = math.log(target / (1.0 - target)) - float(np.median(z))
    for _ in range(30):
        p = _sigmoid(b + z)
        gap = float(np.mean(weight * p)) - target
        slope = float(np.mean(weight * p * (1.0 - p)))
        if abs(gap) < 1e-7 or slope <= 0.0:
            break
        b -= max(-2.0, min(2.0, gap / slope))
    return b


def _simulate_day(
    rng: np.random.Generator,
    world: _World,
    config: WorldConfig,
    ds: str,
    state: np.ndarray,
    bases: dict[str, float],
    fit: bool = False,
) -> tuple[_Day, np.ndarray, dict[str, float]]:
    """One day of impressions and engagements, and the clicks + repins per (user, category) it produced.

    With ``fit``, the intercepts are first fitted so that the day's mean true probabilities hit
    ``TARGET_RATES``; the (possibly refitted) intercepts are returned.
    """
    n_users, n_cat = config.users, config.categories
    day_start = _day_start_us(ds)

    active = np.flatnonzero(rng.random(n_users) < world.user_active_p)
    low = max(1, round(config.impressions_per_user * 0.75))
    high = max(low, round(config.impressions_per_user * 1.25))
    counts = rng.integers(low, high + 1, len(active))
    imp_user = np.repeat(active, counts)
    n = len(imp_user)

    # One session per active user: start uniform in the day, impressions a few seconds apart.
    first = np.cumsum(counts) - counts
    cum = np.cumsum(1.0 + rng.exponential(7.0, n))
    offset_s = cum - np.repeat(cum[first], counts)
    session_len = offset_s[first + counts - 1]
    longest = float(session_len.max()) if len(session_len) else 0.0
    if longest > 80_000.0:  # only with thousands of impressions per user: squeeze sessions into the day
        offset_s *= 80_000.0 / longest
        session_len *= 80_000.0 / longest
    session_start = 1.0 + rng.random(len(active)) * np.maximum(86_400.0 - 1_200.0 - session_len, 1.0)
    imp_ts = day_start + np.round((np.repeat(session_start, counts) + offset_s) * 1e6).astype(np.int64)

    imp_pin = _sample_pins(rng, world, imp_user, state, n_cat)
    imp_surface = rng.choice(len(contracts.SURFACES), n, p=SURFACE_P)
    imp_cat = world.pin_category[imp_pin]

    match = np.einsum("nd,nd->n", world.user_taste[imp_user], world.pin_latent[imp_pin]) / math.sqrt(LATENT_DIM)
    pop = world.pin_pop[imp_pin]
    recent = 1.0 - np.exp(-state[imp_user, imp_cat])
    ubias = world.user_bias[imp_user]
    w = config.recent_weight
    z_click = ubias + 1.0 * match + 0.8 * pop + w * recent + SURFACE_CLICK_OFFSET[imp_surface]
    z_repin = ubias + 1.1 * match + 0.6 * pop + 0.8 * w * recent
    z_hide = -1.2 * match - 0.3 * pop - 0.3 * w * recent
    if fit and n:
        b_hide = _fit_intercept(z_hide, np.ones(n), TARGET_RATES["hide"])
        not_hidden = 1.0 - _sigmoid(b_hide + z_hide)
        bases = {
            "hide": b_hide,
            "click": _fit_intercept(z_click, not_hidden, TARGET_RATES["click"]),
            "repin": _fit_intercept(z_repin, not_hidden, TARGET_RATES["repin"]),
        }
    q_click = _sigmoid(bases["click"] + z_click)
    q_repin = _sigmoid(bases["repin"] + z_repin)
    p_hide = _sigmoid(bases["hide"] + z_hide)

    hide = rng.random(n) < p_hide
    click = ~hide & (rng.random(n) < q_click)
    repin = ~hide & (rng.random(n) < q_repin)
    closeup = click & (rng.random(n) < CLOSEUP_RATE)

    # Engagements come seconds to minutes after their impression, a closeup after its click, all in the day.
    click_delay = 0.5 + rng.exponential(6.0, n)
    delays = {
        _CLICK: click_delay,
        _REPIN: 2.0 + rng.exponential(40.0, n),
        _HIDE: 0.5 + rng.exponential(5.0, n),
        _CLOSEUP: click_delay + 1.0 + rng.exponential(10.0, n),
    }
    day_last = day_start + DAY_US - 1
    labels = {}
    for action, mask in ((_CLICK, click), (_REPIN, repin), (_HIDE, hide), (_CLOSEUP, closeup)):
        src = np.flatnonzero(mask)
        ts = imp_ts[src] + np.round(delays[action][src] * 1e6).astype(np.int64)
        labels[action] = (src, np.minimum(ts, day_last))

    engaged = np.bincount(
        imp_user * n_cat + imp_cat, weights=click.astype(np.float64) + repin, minlength=n_users * n_cat
    ).reshape(n_users, n_cat)
    day = _Day(
        user=imp_user,
        pin=imp_pin,
        surface=imp_surface,
        ts=imp_ts,
        p_click=(1.0 - p_hide) * q_click,
        p_repin=(1.0 - p_hide) * q_repin,
        p_hide=p_hide,
        labels=labels,
    )
    return day, engaged, bases


def _day_tables(day: _Day, ds: str) -> tuple[pa.Table, pa.Table]:
    """The events (sorted by ts, ids assigned in that order) and truth tables of a simulated day."""
    n = len(day.user)
    src = np.concatenate([np.arange(n)] + [s for s, _ in day.labels.values()])
    kind = np.concatenate(
        [np.full(n, _IMP, dtype=np.int8)] + [np.full(len(s), a, dtype=np.int8) for a, (s, _) in day.labels.items()]
    )
    ts = np.concatenate([day.ts] + [t for _, t in day.labels.values()])
    day_start = _day_start_us(ds)
    if len(ts) and (int(ts.min()) < day_start or int(ts.max()) >= day_start + DAY_US):
        raise AssertionError(f"synthetic raw/events ds={ds}: an event timestamp fell outside the day")

    if len(ts) >= EVENT_ID_DAY_STRIDE:
        raise ValueError(
            f"synthetic raw/events ds={ds}: {len(ts)} events do not fit the event id scheme "
            f"(< {EVENT_ID_DAY_STRIDE} a day); use fewer users or impressions per user"
        )
    sort = np.lexsort((kind, src, ts))
    src, kind, ts = src[sort], kind[sort], ts[sort]
    base = (storage.parse_ds(ds) - dt.date(1970, 1, 1)).days * EVENT_ID_DAY_STRIDE
    event_id = base + np.arange(len(ts), dtype=np.int64)
    is_imp = kind == _IMP
    imp_event_id = np.empty(n, dtype=np.int64)
    imp_event_id[src[is_imp]] = event_id[is_imp]

    events = pa.Table.from_arrays(
        [
            pa.array(event_id, pa.int64()),
            pa.array(imp_event_id[src], pa.int64()),
            pa.array(day.user[src] + 1, pa.int64()),
            pa.array(day.pin[src] + 1, pa.int64()),
            _strings(kind, contracts.ACTIONS),
            _strings(day.surface[src], contracts.SURFACES),
            pa.array(ts, contracts.TS),
        ],
        schema=contracts.EVENTS_SCHEMA,
    )
    order = np.argsort(imp_event_id)
    truth = pa.Table.from_arrays(
        [
            pa.array(imp_event_id[order], pa.int64()),
            pa.array(day.p_click[order], pa.float64()),
            pa.array(day.p_repin[order], pa.float64()),
            pa.array(day.p_hide[order], pa.float64()),
        ],
        schema=contracts.TRUTH_SCHEMA,
    )
    return events, truth


def _strings(index: np.ndarray, values: Sequence[str]) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(index.astype(np.int32)), pa.array(list(values))).cast(pa.string())


def _pins_table(world: _World, since_us: int | None = None) -> pa.Table:
    """The corpus; only the pins created at or after ``since_us`` when given (an incremental snapshot)."""
    ids = np.arange(len(world.pin_pop))
    if since_us is not None:
        ids = ids[world.pin_created_us >= since_us]
    content = world.content
    assert content is not None
    embedding = pa.FixedSizeListArray.from_arrays(pa.array(world.pin_embedding[ids].ravel()), world.projection.shape[1])
    return pa.Table.from_arrays(
        [
            pa.array(ids + 1, pa.int64()),
            embedding,
            pa.array(world.pin_category[ids].astype(np.int32), pa.int32()),
            pa.array(world.pin_creator[ids] + 1, pa.int64()),
            pa.array(world.pin_created_us[ids], contracts.TS),
            pa.FixedSizeListArray.from_arrays(pa.array(content.image[ids].ravel()), contracts.IMAGE_DIM),
            pa.ListArray.from_arrays(
                pa.array(np.arange(0, (len(ids) + 1) * TOKENS_PER_PIN, TOKENS_PER_PIN, dtype=np.int32)),
                pa.array(content.tokens[ids].ravel(), pa.int32()),
            ),
        ],
        schema=contracts.PINS_SCHEMA,
    )


def _review_tables(world: _World, config: WorldConfig, ds: str, day_index: int) -> tuple[pa.Table, pa.Table]:
    """The day's human review sample (``raw/pin_labels``) and the truth of every pin (``truth_pins``)."""
    content = world.content
    assert content is not None
    rng = np.random.default_rng(np.random.SeedSequence([config.seed, 12, day_index]))
    n = len(world.pin_pop)
    reviewed = np.sort(rng.choice(n, size=max(1, round(config.review_rate * n)), replace=False))
    true_topic = content.topic[reviewed]
    other = (true_topic + rng.integers(1, contracts.TOPICS, len(reviewed))) % contracts.TOPICS
    topic = np.where(rng.random(len(reviewed)) < REVIEW_AGREEMENT, true_topic, other)
    unsafe = (rng.random(len(reviewed)) < content.p_unsafe[reviewed]).astype(np.int8)
    day_start = _day_start_us(ds)
    reviewed_at = np.sort(day_start + rng.integers(0, DAY_US, len(reviewed)))
    base = (storage.parse_ds(ds) - dt.date(1970, 1, 1)).days * EVENT_ID_DAY_STRIDE
    labels = pa.Table.from_arrays(
        [
            pa.array(base + np.arange(len(reviewed), dtype=np.int64), pa.int64()),
            pa.array(reviewed + 1, pa.int64()),
            pa.array(unsafe, pa.int8()),
            pa.array(topic.astype(np.int32), pa.int32()),
            pa.array(reviewed_at, contracts.TS),
        ],
        schema=contracts.PIN_LABELS_SCHEMA,
    )
    ids = np.arange(n)
    truth = pa.Table.from_arrays(
        [
            pa.array(ids + 1, pa.int64()),
            pa.array(content.p_unsafe[ids], pa.float64()),
            pa.FixedSizeListArray.from_arrays(pa.array(content.review_probs(ids).ravel()), contracts.TOPICS),
        ],
        schema=contracts.TRUTH_PINS_SCHEMA,
    )
    return labels, truth


def _users_table(world: _World) -> pa.Table:
    return pa.Table.from_arrays(
        [
            pa.array(np.arange(1, len(world.user_bias) + 1), pa.int64()),
            _strings(world.user_country, COUNTRIES),
            pa.array(world.user_created_us, contracts.TS),
        ],
        schema=contracts.USERS_SCHEMA,
    )


def generate_world(root: str | os.PathLike[str], config: WorldConfig) -> dict[str, Any]:
    """Write ``raw/events``, ``raw/pins``, ``raw/users`` and ``truth`` for every day of ``config``.

    Days are generated in order because the hidden recent-interest state carries over. A few unwritten
    burn-in days run first so that the first written day already has a settled recent-interest state.
    Each partition is written atomically; rerunning replaces the same days with identical data. Returns
    a summary: the days, event and impression totals, positive rate per engagement action (per
    impression), and corpus sizes.
    """
    world = _build_world(config)
    state = np.zeros((config.users, config.categories))
    bases = {label: math.log(rate / (1.0 - rate)) for label, rate in TARGET_RATES.items()}
    users = _users_table(world)
    totals = dict.fromkeys(("impressions", *contracts.ENGAGEMENTS), 0)
    events_total = 0
    meta = {"generator": "features.synthetic", "config": dataclasses.asdict(config)}
    for day_index in range(-BURN_IN_DAYS, config.days):
        ds = storage.shift_ds(config.start, day_index)
        if day_index > 0:
            # New pins are created at the start of their day, before any impression of that day.
            new_rng = np.random.default_rng(np.random.SeedSequence([config.seed, 2, day_index]))
            count = round(NEW_PIN_RATE * config.pins)
            content_rng = np.random.default_rng(np.random.SeedSequence([config.seed, 11, day_index]))
            world.add_pins(new_rng, count, np.full(count, _day_start_us(ds), dtype=np.int64), content_rng)
        rng = np.random.default_rng(np.random.SeedSequence([config.seed, 1, day_index + BURN_IN_DAYS]))
        # Passing interests: a new hidden interest in a random category for some users.
        shocked = np.flatnonzero(rng.random(config.users) < SHOCK_RATE)
        state[shocked, rng.integers(0, config.categories, len(shocked))] += 1.0
        # Burn-in days refit the label intercepts so that the positive rates are near TARGET_RATES for any
        # size and seed; the written days keep the last fit.
        day, engaged, bases = _simulate_day(rng, world, config, ds, state, bases, fit=day_index < 0)
        # Saturating boost: the first engagement with a category counts most, which keeps the feedback
        # loop (interest -> impressions -> engagements -> interest) bounded.
        state = INTEREST_DECAY * state + (1.0 - 0.5**engaged)
        if day_index < 0:
            continue

        events, truth = _day_tables(day, ds)
        storage.write_table(root, contracts.RAW_EVENTS, ds, events, {**meta, "rows": events.num_rows})
        if config.incremental_pins and day_index > 0:
            pins = _pins_table(world, since_us=_day_start_us(ds))
            storage.write_table(root, contracts.RAW_PINS, ds, pins, {**meta, "rows": pins.num_rows, "snapshot": "incremental"})
        else:
            pins = _pins_table(world)
            storage.write_table(root, contracts.RAW_PINS, ds, pins, {**meta, "rows": pins.num_rows})
        storage.write_table(root, contracts.RAW_USERS, ds, users, {**meta, "rows": users.num_rows})
        truth_meta = {**meta, "rows": truth.num_rows, "intercepts": {k: round(v, 6) for k, v in bases.items()}}
        storage.write_table(root, contracts.TRUTH, ds, truth, truth_meta)
        labels, truth_pins = _review_tables(world, config, ds, day_index)
        storage.write_table(root, contracts.RAW_PIN_LABELS, ds, labels, {**meta, "rows": labels.num_rows})
        storage.write_table(root, contracts.TRUTH_PINS, ds, truth_pins, {**meta, "rows": truth_pins.num_rows})
        events_total += events.num_rows
        totals["impressions"] += len(day.user)
        for action, (src, _) in day.labels.items():
            totals[contracts.ACTIONS[action]] += len(src)

    impressions = totals["impressions"]
    return {
        "days": config.day_list,
        "events": events_total,
        "impressions": impressions,
        "positive_rates": {
            action: round(totals[action] / impressions, 5) if impressions else 0.0 for action in contracts.ENGAGEMENTS
        },
        "pins": len(world.pin_pop),
        "users": config.users,
    }


def main(argv: Sequence[str] | None = None) -> int:
    defaults = WorldConfig(start="1970-01-01", days=1)
    parser = argparse.ArgumentParser(
        prog="python -m features.synthetic",
        description="Generate a deterministic synthetic world (raw/events, raw/pins, raw/users, truth) "
        "under a storage root, one partition per day. Prints a JSON summary line.",
    )
    parser.add_argument("--root", required=True, help="storage root: a local folder, a file:// or an s3:// URL")
    parser.add_argument("--start", required=True, help="first day, YYYY-MM-DD")
    parser.add_argument("--days", type=int, required=True, help="number of consecutive days to generate")
    parser.add_argument("--users", type=int, default=defaults.users, help="number of users (default: %(default)s)")
    parser.add_argument(
        "--pins",
        type=int,
        default=defaults.pins,
        help="pins in the corpus on the first day; 1%% more arrive each later day (default: %(default)s)",
    )
    parser.add_argument(
        "--categories", type=int, default=defaults.categories, help="number of pin categories (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="random seed (default: %(default)s)")
    parser.add_argument(
        "--impressions-per-user",
        type=int,
        default=defaults.impressions_per_user,
        help="mean impressions of an active user per day, ±25%% (default: %(default)s)",
    )
    parser.add_argument(
        "--active-rate",
        type=float,
        default=defaults.active_rate,
        help="mean probability that a user is active on a day (default: %(default)s)",
    )
    parser.add_argument(
        "--recent-weight",
        type=float,
        default=defaults.recent_weight,
        help="weight of the hidden recent-interest term in the click and repin logits; 0 turns it off (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        config = WorldConfig(
            start=args.start,
            days=args.days,
            users=args.users,
            pins=args.pins,
            categories=args.categories,
            seed=args.seed,
            impressions_per_user=args.impressions_per_user,
            active_rate=args.active_rate,
            recent_weight=args.recent_weight,
        )
    except ValueError as err:
        parser.error(str(err))
    summary = generate_world(args.root, config)
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
