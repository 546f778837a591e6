"""Multi-turn environments and tools for agentic RL: an environment per episode
(`reset() -> messages`, `step(message) -> Step`), tools from Python callables, episodes run on
the generation engine token in / token out (`run_episodes`), and the built-in environments."""

from posttrain.envs._base import (
    Environment,
    Step,
    Tool,
    ToolEnvironment,
    env_names,
    make_env,
    prompt_messages,
    register_env,
    rewards_itself,
    takes_tool_budget,
    tool_message,
)
from posttrain.envs._builtin import CALCULATOR_SYSTEM, FaultInjection, calculate
from posttrain.envs._cad import CAD_SYSTEM, cad_env
from posttrain.envs._cad import describe as describe_measurements
from posttrain.envs._clarify import (
    CLARIFY_SYSTEM,
    ClarifyEnvironment,
    clarify_episode,
    clarify_tasks,
    scripted_turns,
)
from posttrain.envs._endpoint import EpisodeServer
from posttrain.envs._episode import FINISH_REASONS, Budget, Episode, episode_metrics
from posttrain.envs._episodes import Shared, run_episodes
from posttrain.envs._pool import ElasticPool
from posttrain.envs._retrieval import (
    RETRIEVAL_SYSTEM,
    RetrievalEnvironment,
    cited_answer,
    context_records,
    long_document_tasks,
    retrieval_records,
)
from posttrain.envs._terminal import TerminalEnvironment, TerminalOptions, terminal_tasks

__all__ = [
    "FINISH_REASONS",
    "Budget",
    "ElasticPool",
    "Episode",
    "EpisodeServer",
    "FaultInjection",
    "cad_env",
    "calculate",
    "episode_metrics",
    "run_episodes",
    "Shared",
    "Environment",
    "Step",
    "TerminalEnvironment",
    "TerminalOptions",
    "terminal_tasks",
    "Tool",
    "ToolEnvironment",
    "env_names",
    "make_env",
    "prompt_messages",
    "register_env",
    "rewards_itself",
    "takes_tool_budget",
    "tool_message",
    "CAD_SYSTEM",
    "describe_measurements",
    "CALCULATOR_SYSTEM",
    "CLARIFY_SYSTEM",
    "ClarifyEnvironment",
    "clarify_episode",
    "clarify_tasks",
    "scripted_turns",
    "RETRIEVAL_SYSTEM",
    "RetrievalEnvironment",
    "cited_answer",
    "context_records",
    "long_document_tasks",
    "retrieval_records",
]
