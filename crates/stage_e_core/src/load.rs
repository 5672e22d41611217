//! Load averages of a cap: slots held and throttles per minute, each as an exponentially
//! weighted moving average over 1, 5 and 15 minutes (as the Unix load average), decayed by the
//! real time between samples. Stored as f64 bits in atomics: one process (the launcher) writes
//! them, anyone reads them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Averaging windows, in seconds.
pub const WINDOWS: [f64; 3] = [60.0, 300.0, 900.0];

/// Three averages, one per window.
#[repr(C)]
#[derive(Default)]
pub struct Averages([AtomicU64; 3]);

impl Averages {
    /// Starts every average at `x` (a cap's first sample).
    pub fn start(&self, x: f64) {
        for a in &self.0 {
            a.store(x.to_bits(), Relaxed);
        }
    }

    /// Moves each average toward `x`, `dt` seconds after the previous sample.
    pub fn sample(&self, x: f64, dt: f64) {
        for (a, window) in self.0.iter().zip(WINDOWS) {
            let keep = (-dt / window).exp();
            let old = f64::from_bits(a.load(Relaxed));
            a.store((old * keep + x * (1.0 - keep)).to_bits(), Relaxed);
        }
    }

    pub fn read(&self) -> [f64; 3] {
        self.0.each_ref().map(|a| f64::from_bits(a.load(Relaxed)))
    }

    pub fn clear(&self) {
        self.start(0.0);
    }
}

/// Events per minute between two samples `dt` seconds apart.
pub fn per_minute(events: u64, dt: f64) -> f64 {
    events as f64 / dt * 60.0
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn a_step_moves_each_window_by_its_time_constant() {
        let a = Averages::default();
        a.start(0.0);
        // One minute of samples at 4 held, every 5 s.
        for _ in 0..12 {
            a.sample(4.0, 5.0);
        }
        let [one, five, fifteen] = a.read();
        let expect = |w: f64| 4.0 * (1.0 - (-60.0 / w).exp());
        assert!((one - expect(60.0)).abs() < 1e-9, "{one}");
        assert!((five - expect(300.0)).abs() < 1e-9, "{five}");
        assert!((fifteen - expect(900.0)).abs() < 1e-9, "{fifteen}");
        assert!(one > five && five > fifteen);
    }

    #[test]
    fn uneven_samples_decay_by_real_time() {
        // One 10 s gap is the same as two 5 s gaps at a constant input.
        let (a, b) = (Averages::default(), Averages::default());
        a.start(1.0);
        b.start(1.0);
        a.sample(3.0, 10.0);
        b.sample(3.0, 5.0);
        b.sample(3.0, 5.0);
        for (x, y) in a.read().into_iter().zip(b.read()) {
            assert!((x - y).abs() < 1e-12);
        }
    }

    #[test]
    fn rates_are_per_minute() {
        assert_eq!(per_minute(10, 5.0), 120.0);
        assert_eq!(per_minute(0, 5.0), 0.0);
    }
}
