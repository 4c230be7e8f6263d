"""/status as HTML: a self-refreshing page with the block coverage drawn as inline SVG and a table of servers."""

from html import escape

from bloombee.client.swarm_status import ModelStatus, ServerStatus, usable

WIDTH, ROW, LEFT = 900, 26, 150
COLORS = {"online": "#2e9d4f", "joining": "#e0a526", "offline": "#9a9a9a", "incompatible": "#c0392b"}


def server_color(server: ServerStatus) -> str:
    return COLORS["incompatible"] if server.problem else COLORS.get(server.state, COLORS["offline"])


def coverage_svg(status: ModelStatus) -> str:
    """Blocks along x: an axis of block numbers, a row of per-block server counts written in each cell (red where
    none), then one bar per server."""
    scale = (WIDTH - LEFT - 10) / max(status.num_blocks, 1)
    height = ROW * (len(status.servers) + 2) + 10
    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" role="img" '
              f'aria-label="block coverage of {escape(status.model)}">')]
    parts += block_axis(status.num_blocks, scale)
    parts += count_row(status.servers_per_block(), scale, 4 + ROW)
    for row, server in enumerate(status.servers, start=2):
        parts += server_bar(server, scale, 4 + row * ROW)
    parts.append("</svg>")
    return "".join(parts)


def block_axis(num_blocks: int, scale: float) -> list[str]:
    """The top row: block numbers, every `axis_step`-th one where all would not fit."""
    step = axis_step(num_blocks, scale)
    parts = [f'<text x="4" y="{ROW - 8}" font-size="12">block</text>']
    for block in range(0, num_blocks, step):
        x = LEFT + (block + 0.5) * scale
        parts.append(f'<text class="axis" x="{x:.1f}" y="{ROW - 8}" font-size="10" text-anchor="middle">{block}</text>')
    return parts


def axis_step(num_blocks: int, scale: float) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... blocks between two labels that leaves room for the longest number."""
    room = 7 * len(str(max(num_blocks - 1, 0)))
    step = 1
    while step * scale < room:
        step = step * 5 // 2 if str(step).startswith("2") else step * 2
    return step


def count_row(counts: list[int], scale: float, y: float) -> list[str]:
    """Per block, a cell coloured by how many usable servers hold it, with that count written in it."""
    font = min(11.0, max(6.0, scale - 2))
    parts = [f'<text x="4" y="{y + ROW - 10}" font-size="12">servers per block</text>']
    for block, count in enumerate(counts):
        x = LEFT + block * scale
        fill = "#c0392b" if count == 0 else "#d5f0dc" if count == 1 else "#8fd3a3"
        parts.append(f'<rect class="block" data-block="{block}" data-servers="{count}" x="{x:.1f}" y="{y}" '
                     f'width="{scale - 1:.1f}" height="{ROW - 6}" fill="{fill}"><title>block {block}: {count} servers</title></rect>')
        parts.append(f'<text class="count" x="{x + scale / 2:.1f}" y="{y + ROW - 10}" font-size="{font:g}" '
                     f'text-anchor="middle" fill="{"white" if count == 0 else "black"}">{count}</text>')
    return parts


def server_bar(server: ServerStatus, scale: float, y: float) -> list[str]:
    """One server's name on the left and its block range as a bar coloured by its state."""
    x, width = LEFT + server.start_block * scale, (server.end_block - server.start_block) * scale - 1
    label = f"{server.label} {server.start_block}:{server.end_block} {server.state}"
    return [f'<text x="4" y="{y + ROW - 10}" font-size="12">{escape(server.label)}</text>',
            (f'<rect class="server" data-name="{escape(server.label)}" data-state="{escape(server.state)}" '
             f'x="{x:.1f}" y="{y}" width="{width:.1f}" height="{ROW - 6}" rx="4" fill="{server_color(server)}">'
             f'<title>{escape(label)}</title></rect>'),
            f'<text x="{x + 6:.1f}" y="{y + ROW - 10}" font-size="11" fill="white">{escape(label)}</text>']


def servers_table(status: ModelStatus) -> str:
    header = ("server", "blocks", "state", "block-steps/s", "weights", "free cache tokens", "link Mbit/s", "version", "features", "note")
    rows = ["<tr>" + "".join(f"<th>{name}</th>" for name in header) + "</tr>"]
    for server in status.servers:
        cells = (server.label, f"{server.start_block}:{server.end_block}", server.state, f"{server.throughput:.1f}",
                 server.weights_text, str(server.cache_tokens_left), f"{server.link_mbps:.0f}", server.version, ", ".join(server.features),
                 server.problem or "")
        css = "usable" if usable(server) else "unusable"
        rows.append(f'<tr class="{css}">' + "".join(f"<td>{escape(cell)}</td>" for cell in cells) + "</tr>")
    return "<table>" + "".join(rows) + "</table>"


def render_status(status: ModelStatus, api: dict, refresh_seconds: float) -> str:
    """The whole page."""
    chain = " &rarr; ".join(escape(link) for link in status.chain) if status.full_chain else "<b>no full chain</b>"
    gaps = f"<p class='gaps'>Blocks served by nobody: {escape(status.uncovered_text)}</p>" if status.uncovered else ""
    return (f"<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='{refresh_seconds:g}'>"
            f"<title>BloomBee swarm: {escape(status.model)}</title><style>body{{font-family:sans-serif;margin:1.5em}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}"
            ".unusable{color:#888}.gaps{color:#c0392b;font-weight:bold}</style></head><body>"
            f"<h1>{escape(status.model)}</h1><p>{status.num_blocks} blocks, {len(status.servers)} servers. "
            f"Chain: <span id='chain'>{chain}</span></p>{gaps}{coverage_svg(status)}{servers_table(status)}"
            f"<p>API: {api['active_sessions']} sessions open, {api['waiting_requests']} requests waiting, "
            f"{api['batches_run']} batches run. Reloads every {refresh_seconds:g} s; JSON at "
            "<a href='/status.json'>/status.json</a>.</p></body></html>")
