"""A two-node LangGraph graph (no model) checkpointed by KVMemSaver, for test_langgraph_saver.py.

Run as a script, it takes one turn of thread ``t`` in a kvmem directory and prints the state as JSON:
``python tiny_graph.py DIR '{"catalog_url": ...}' '{"log": ["hello"], "turns": 0}'``.
"""

from __future__ import annotations

import json
import operator
import sys
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

import kvmem
from langchain_kvmem import KVMemSaver

CONFIG = {"configurable": {"thread_id": "t"}}


class State(TypedDict):
    log: Annotated[list[str], operator.add]
    turns: int


def think(state: State) -> dict[str, Any]:
    return {"log": [f"think {state['turns']}"]}


def act(state: State) -> dict[str, Any]:
    return {"log": [f"act {state['turns']} after {len(state['log'])}"], "turns": state["turns"] + 1}


def build(saver: KVMemSaver) -> CompiledStateGraph:
    """START -> think -> act -> END, checkpointed by ``saver``."""
    graph = StateGraph(State)
    graph.add_node("think", think)
    graph.add_node("act", act)
    graph.add_edge(START, "think")
    graph.add_edge("think", "act")
    graph.add_edge("act", END)
    return graph.compile(checkpointer=saver)


if __name__ == "__main__":
    with kvmem.Memory(sys.argv[1], fsync="never", **json.loads(sys.argv[2])) as mem:
        print(json.dumps(build(KVMemSaver(mem)).invoke(json.loads(sys.argv[3]), CONFIG)))
