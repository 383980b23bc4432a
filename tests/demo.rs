//! `kvroute demo --once`: the router and a 4-worker simulated fleet replay the
//! bundled trace under `kv` and `round_robin`; `kv` must come out ahead.

mod common;

/// The percentage in column `column` of the table row starting with `row`.
fn cell(table: &str, row: &str, column: usize) -> f64 {
    let line = table
        .lines()
        .find(|l| l.starts_with(row))
        .unwrap_or_else(|| panic!("no row `{row}` in\n{table}"));
    let cells: Vec<&str> = line[row.len()..].split_whitespace().collect();
    cells[column].trim_end_matches('%').parse().unwrap()
}

#[test]
fn demo_once_shows_kv_ahead_of_round_robin() {
    let output = common::kvroute_output(&["demo", "--once"]);
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{table}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let header: Vec<&str> = table
        .lines()
        .find(|l| l.contains("round_robin"))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(header, ["kv", "round_robin"]);
    let kv = cell(&table, "prefix hit rate (workers)", 0);
    let round_robin = cell(&table, "prefix hit rate (workers)", 1);
    assert!(
        kv > round_robin * 1.2,
        "kv {kv}% vs round_robin {round_robin}%\n{table}"
    );
    assert_eq!(cell(&table, "failed requests", 0), 0.0, "{table}");
}
